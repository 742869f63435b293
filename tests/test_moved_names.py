"""The import paths issue 57's layout moved keep working for one release, with a DeprecationWarning."""

import importlib
import sys

import pytest

MOVED = {"seq2seq.translator": ("seq2seq.inference.translator", "Translator"),
         "seq2seq.search": ("seq2seq.decoding.config", "SearchConfig"),
         "seq2seq.tokenizer": ("seq2seq.text.tokenizer", "Tokenizer")}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_warns_and_gives_the_same_objects(old: str, monkeypatch: pytest.MonkeyPatch):
    new, name = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported afresh: the warning comes at import
    with pytest.warns(DeprecationWarning, match=f"{old} is now {new.rsplit('.', 1)[0] if old == 'seq2seq.search' else new}"):
        module = importlib.import_module(old)
    moved = importlib.import_module(new)
    assert getattr(module, name) is getattr(moved, name)
    names = [key for key in vars(moved) if not key.startswith("__")]
    assert all(getattr(module, key) is getattr(moved, key) for key in names)  # those `import *` leaves out, too
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018
