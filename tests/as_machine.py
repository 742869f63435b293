"""python -m as_machine MACHINE TARGET [ARGS...]: `python -m TARGET ARGS...` (or `python TARGET ARGS...` for
a .py file) as if on MACHINE, a key of machines.MACHINES; tests/ must be on PYTHONPATH.

What `auto` decides in this process follows MACHINE. The DDP processes Lightning starts run
`python -m TARGET` itself, unpretended, and inherit this process's decisions as they would from any
launcher (the precision through the environment, seq2seq/training/fit.py; the attention's from rank 0,
seq2seq/training/module.py).
"""

import runpy
import sys

from machines import MACHINES

import seq2seq.precision
from seq2seq.precision import Verdict

if __name__ == "__main__":
    machine, target, *args = sys.argv[1:]
    seq2seq.precision.this_cpu = lambda: MACHINES[machine]
    if target == "seq2seq.fit":  # (imported for training alone: it brings Lightning)
        import seq2seq.training.machine

        # Compiling pays or not by this CPU's timing, which a pretended machine cannot stand in for: eager, as
        # the in-process tests train
        seq2seq.training.machine.compiled_step_pays = lambda *a, **k: Verdict(False, "pinned: a pretended machine")
    sys.argv = [target, *args]
    if target.endswith(".py"):
        sys.path.insert(0, str(__import__("pathlib").Path(target).resolve().parent))  # as `python FILE` does
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
