"""Deprecated: `seq2seq.search` is now seq2seq/decoding/ (issue 57's layout): SearchConfig and Hypothesis in
`seq2seq.decoding.config`, `decode` in `seq2seq.decoding.search`, the searches in `beam` and `sampling`, the
ranking in `ranking` and `steps`. This name keeps working, with a DeprecationWarning, for one release
(`from seq2seq.search import SearchConfig` as before); then it goes."""

import warnings

import seq2seq.decoding.beam
import seq2seq.decoding.config
import seq2seq.decoding.ranking
import seq2seq.decoding.sampling
import seq2seq.decoding.search
import seq2seq.decoding.steps
from seq2seq.decoding.beam import *  # noqa: F403 (what the modules offer, under the old name)
from seq2seq.decoding.config import *  # noqa: F403
from seq2seq.decoding.ranking import *  # noqa: F403
from seq2seq.decoding.sampling import *  # noqa: F403
from seq2seq.decoding.search import *  # noqa: F403
from seq2seq.decoding.steps import *  # noqa: F403

_MOVED = (seq2seq.decoding.search, seq2seq.decoding.config, seq2seq.decoding.beam, seq2seq.decoding.sampling,
          seq2seq.decoding.ranking, seq2seq.decoding.steps)

warnings.warn("seq2seq.search is now seq2seq.decoding (SearchConfig: seq2seq.decoding.config; decode: "
              "seq2seq.decoding.search); the old name goes in the next release", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:  # the modules' other names too (those `import *` leaves out)
    for module in _MOVED:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'seq2seq.search' has no attribute {name!r}")
