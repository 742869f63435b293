"""The rules of the layout (docs/architecture.md#rules), checked over the source, so that the change that breaks one fails
here: every import of seq2seq/ and serve/ read with `ast` (those inside functions included), and every
assignment to an attribute."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The faces: commands a user runs. They share seq2seq/cli.py; nothing imports them.
FACES = {"seq2seq.translate", "seq2seq.score", "seq2seq.export", "seq2seq.convert", "seq2seq.average", "seq2seq.fit",
         "seq2seq.interactive", "seq2seq.serve.server"}
# Scripts that run a face and do nothing else: each imports its face only.
SCRIPTS = {"serve.server": "seq2seq.serve.server", "serve.translate": "seq2seq.interactive",
           "seq2seq.serve.__main__": "seq2seq.serve.server"}
# The old import paths, kept one release (tests/test_moved_names.py): each imports where its names went.
MOVED = {"seq2seq.translator": "seq2seq.inference", "seq2seq.search": "seq2seq.decoding",
         "seq2seq.tokenizer": "seq2seq.text"}
# What trains: the only package that imports Lightning.
TRAINING = "seq2seq.training"
# Training never imports inference: the length penalty is tuned by seq2seq/inference/tune.py, which the face runs.
INFERENCE = {"seq2seq.inference", "seq2seq.cli", "seq2seq.serve", "seq2seq.interop"}
# The floors, lowest first: a module imports from a lower floor, or from its own package; never from a higher floor,
# nor from another package of its own floor (decoding and text know nothing of each other).
FLOORS = [
    {"seq2seq.model", "seq2seq.textio", "seq2seq.demo"},  # pure PyTorch; the standard library; the demo's data
    {"seq2seq.decoding", "seq2seq.text", "seq2seq.precision"},  # the searches; text in and out; the machine
    {"seq2seq.checkpoint"},  # the checkpoint format
    {"seq2seq.inference", "seq2seq.interop", "seq2seq.training"},  # what uses a checkpoint
    {"seq2seq.cli"},  # what the faces share
    {"seq2seq.serve"},  # the server (its command, seq2seq/serve/server.py, is a face)
    FACES | set(MOVED),
    set(SCRIPTS) - FACES,
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, ast.Module]:
    """Each module of seq2seq/ and serve/ (dotted, as a face's file would be named), parsed; seq2seq/__init__.py,
    which imports nothing (test_the_package_itself_imports_nothing), left out."""
    paths = sorted([*(REPO / "seq2seq").rglob("*.py"), *(REPO / "serve").glob("*.py")])
    paths.remove(REPO / "seq2seq" / "__init__.py")
    return {module_name(path): ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for path in paths}


def imports() -> dict[str, set[str]]:
    """Each module, and what it imports: modules, and `module.name` for each name taken from one."""
    found: dict[str, set[str]] = {}
    for module, tree in sources().items():
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from seq2seq import fit`
        found[module] = names
    return found


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def floor_of(name: str) -> tuple[int, str] | None:
    """(floor, package) of one of our modules, most specific first (a face of seq2seq/serve/ is a face)."""
    best = None
    for level, packages in enumerate(FLOORS):
        for package in packages:
            if under(name, package) and (best is None or len(package) > len(best[1])):
                best = (level, package)
    return best


def test_the_scan_sees_every_module_and_their_imports():
    found = imports()
    assert FACES | {"seq2seq.training.fit", "seq2seq.model.transformer", "seq2seq.inference.translator"} <= set(found)
    assert any(under(name, "lightning") for name in found["seq2seq.training.module"])
    assert "seq2seq.cli" in found["seq2seq.serve.server"] and "seq2seq.serve.server" in found["serve.server"]
    assert "seq2seq.training.fit" in found["seq2seq.fit"]
    unplaced = sorted(module for module in found if floor_of(module) is None)
    assert not unplaced, f"every module has a floor in FLOORS: {unplaced}"


def test_the_package_itself_imports_nothing():
    tree = ast.parse((REPO / "seq2seq" / "__init__.py").read_text(encoding="utf-8"))
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def test_every_import_points_down():
    wrong = []
    for module, names in imports().items():
        mine = floor_of(module)
        assert mine is not None
        for name in names:
            theirs = floor_of(name) if under(name, "seq2seq") and name != "seq2seq" else None
            if theirs is not None and theirs[1] != mine[1] and theirs[0] >= mine[0]:
                if SCRIPTS.get(module) == theirs[1] or MOVED.get(module) == theirs[1]:
                    continue
                wrong.append((module, name))
    assert not wrong, f"imports point down the floors (tests/test_layout.py's FLOORS): {sorted(wrong)}"


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
    assert not wrong, f"training never imports the translator, the server or the faces' plumbing: {wrong}"


def test_the_model_imports_nothing_of_ours_outside_it():
    wrong = sorted((module, name) for module, names in imports().items() if under(module, "seq2seq.model")
                   for name in names if under(name, "seq2seq") and not under(name, "seq2seq.model"))
    assert not wrong, f"seq2seq/model/ is pure PyTorch: {wrong}"


def outside_assignments(tree: ast.Module) -> list[str]:
    """Attributes set on a class, or on one of our modules, from outside it: `Name.attr = ...` (or `+=`,
    `setattr(Name, ...)`) where Name is a class imported into the module, a class the module defines (set from
    outside its body), or a module of ours imported under a name."""
    imported_classes, our_modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            for alias in node.names:
                bound = alias.asname or alias.name
                if alias.name[:1].isupper():
                    imported_classes.add(bound)
                elif under(node.module, "seq2seq"):  # a module of ours (or a function: no attributes set on it either)
                    our_modules.add(bound)
        elif isinstance(node, ast.Import):
            our_modules.update(alias.asname for alias in node.names if alias.asname and under(alias.name, "seq2seq"))
    defined = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}

    def owner(target: ast.expr) -> str | None:
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            name = target.value.id
            if name in imported_classes or name in our_modules or name in defined:
                return f"{name}.{target.attr}"
        return None

    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        found += [f"line {node.lineno}: {name}" for name in map(owner, targets) if name]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and isinstance(node.args[0], ast.Name)
                and owner(ast.Attribute(value=node.args[0], attr="*")) is not None):
            found.append(f"line {node.lineno}: setattr({node.args[0].id}, ...)")
    return found


def test_nothing_sets_an_attribute_on_a_class_or_a_module_of_ours_from_outside_it():
    wrong = {module: found for module, tree in sources().items() if (found := outside_assignments(tree))}
    assert not wrong, f"a choice is passed to what uses it, never set on a class or module: {wrong}"


@pytest.mark.parametrize("code", [
    "from seq2seq.model import MultiHeadAttention\nMultiHeadAttention.one_query_by_matmul = False",
    "from seq2seq.model.attention import MultiHeadAttention\ndef f():\n    MultiHeadAttention.x += 1",
    "from seq2seq.model import MultiHeadAttention\nsetattr(MultiHeadAttention, 'x', 1)",
    "import seq2seq.decoding.ranking as ranking\nranking.TOP_K_CHUNK = 8",
    "from seq2seq.decoding import ranking\nranking.TOP_K_CHUNK = 8",
    "class Kind:\n    pass\n\nKind.extra = 1",
])
def test_the_attribute_scan_finds_what_it_forbids(code: str):
    assert outside_assignments(ast.parse(code))


def test_the_attribute_scan_leaves_instances_and_classes_own_settings_alone():
    code = ("from seq2seq.model import Transformer\nclass Kind:\n    size = 1\n    def grow(self):\n"
            "        self.size += 1\n        type(self).count = 0\nmodel = Transformer(config)\nmodel.training = False\n")
    assert outside_assignments(ast.parse(code)) == []
