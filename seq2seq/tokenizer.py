"""Deprecated: `seq2seq.tokenizer` is `seq2seq.text.tokenizer` (issue 57's layout). This name keeps working, with a
DeprecationWarning, for one release (`from seq2seq.tokenizer import Tokenizer` as before); then it goes."""

import warnings

import seq2seq.text.tokenizer as _moved
from seq2seq.text.tokenizer import *  # noqa: F403 (what the module offers, under its old name)

warnings.warn("seq2seq.tokenizer is now seq2seq.text.tokenizer; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:  # the module's other names too (those `import *` leaves out)
    return getattr(_moved, name)
