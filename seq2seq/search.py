"""Deprecated: `seq2seq.search` is `seq2seq.decoding.search` (issue 57's layout). This name keeps working, with a
DeprecationWarning, for one release (`from seq2seq.search import SearchConfig` as before); then it goes."""

import warnings

import seq2seq.decoding.search as _moved
from seq2seq.decoding.search import *  # noqa: F403 (what the module offers, under its old name)

warnings.warn("seq2seq.search is now seq2seq.decoding.search; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:  # the module's other names too (those `import *` leaves out)
    return getattr(_moved, name)
