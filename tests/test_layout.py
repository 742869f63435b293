"""The import rules of the layout (README, "The model"; issue 23), checked over the source, so that the
change that breaks one fails here: every import of seq2seq/ and serve/ read with `ast`, those inside
functions included."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The faces: commands a user runs. They share seq2seq/cli.py; nothing imports them.
FACES = {"seq2seq.translate", "seq2seq.score", "seq2seq.export", "seq2seq.convert", "seq2seq.average", "seq2seq.fit",
         "seq2seq.interactive", "seq2seq.serve.server"}
# Scripts that run a face and do nothing else: each imports its face only.
SCRIPTS = {"serve.server": "seq2seq.serve.server", "serve.translate": "seq2seq.interactive",
           "seq2seq.serve.__main__": "seq2seq.serve.server"}
# What trains: the only package that imports Lightning.
TRAINING = "seq2seq.training"
# Training never imports inference: the length penalty is tuned by seq2seq/inference/tune.py, which the face runs.
INFERENCE = {"seq2seq.inference", "seq2seq.cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each module of seq2seq/ and serve/ (dotted, as a face's file would be named), and what it imports."""
    found: dict[str, set[str]] = {}
    for path in sorted([*(REPO / "seq2seq").rglob("*.py"), *(REPO / "serve").glob("*.py")]):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from seq2seq import fit`
        found[module_name(path)] = names
    return found


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_scan_sees_every_module_and_their_imports():
    found = imports()
    assert FACES | INFERENCE | {"seq2seq.training.fit", "seq2seq.model.transformer"} <= set(found)
    assert any(under(name, "lightning") for name in found["seq2seq.training.module"])
    assert "seq2seq.cli" in found["seq2seq.serve.server"] and "seq2seq.serve.server" in found["serve.server"] and "seq2seq.training.fit" in found["seq2seq.fit"]


def test_no_module_imports_a_face():
    wrong = sorted((module, name) for module, names in imports().items() for name in names
                   for face in FACES if under(name, face) and module != face and SCRIPTS.get(module) != face)
    assert not wrong, f"faces import cli.py and what lies below, never another face: {wrong}"


def test_only_training_imports_lightning():
    wrong = sorted((module, name) for module, names in imports().items() if not under(module, TRAINING)
                   for name in names if under(name, "lightning") or under(name, "pytorch_lightning"))
    assert not wrong, f"Lightning stays in seq2seq/training/: {wrong}"


def test_training_imports_no_inference():
    wrong = sorted((module, name) for module, names in imports().items() if under(module, TRAINING)
                   for name in names for inference in INFERENCE
                   if under(name, inference))
    assert not wrong, f"training never imports the translator or the faces' plumbing: {wrong}"


def test_the_model_imports_nothing_of_ours_outside_it():
    wrong = sorted((module, name) for module, names in imports().items() if under(module, "seq2seq.model")
                   for name in names if under(name, "seq2seq") and not under(name, "seq2seq.model"))
    assert not wrong, f"seq2seq/model/ is pure PyTorch: {wrong}"
