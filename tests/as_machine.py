"""python -m as_machine MACHINE MODULE [ARGS...]: `python -m MODULE ARGS...` as if on MACHINE (a key of
machines.MACHINES), with tests/ on PYTHONPATH. What `auto` decides in this process follows MACHINE; the
DDP processes Lightning starts run `python -m MODULE` itself and inherit those decisions, as they do
from any launcher (seq2seq/fit.py, module.py)."""

import runpy
import sys

from machines import MACHINES

import seq2seq.model.precision

if __name__ == "__main__":
    machine, module, *args = sys.argv[1:]
    seq2seq.model.precision.this_cpu = lambda: MACHINES[machine]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
