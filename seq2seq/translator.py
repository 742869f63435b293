"""Deprecated: `seq2seq.translator` is `seq2seq.inference.translator` (issue 57's layout). This name keeps working, with a
DeprecationWarning, for one release (`from seq2seq.translator import Translator` as before); then it goes."""

import warnings

import seq2seq.inference.translator as _moved
from seq2seq.inference.translator import *  # noqa: F403 (what the module offers, under its old name)

warnings.warn("seq2seq.translator is now seq2seq.inference.translator; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:  # the module's other names too (those `import *` leaves out)
    return getattr(_moved, name)
