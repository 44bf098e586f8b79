"""brf.bytes: every member as a model over bytes, exactly or with a reported pruned mass.

Three settings of one code path (`brf.bytes.lm.score_text`):

* ``EXACT``: no pruning, no merging. Every covering tokenization counts, so the
  distributions are the member's own (checked against brute-force enumeration in
  the tests); the cover grows exponentially with the text, so it is for short
  strings.
* ``REFERENCE``: a tiny threshold, a wide beam, no merging; feasible on slices of
  a few thousand bytes. What the defaults are measured against
  (`brf.bytes.precision`, the study's precision check, BENCHMARKS.md).
* ``DEFAULT``: what scoring, the study and byte-level generation use unless told
  otherwise; its measured distance from the reference is reported with every
  result that rests on it.
"""

from typing import NamedTuple


class Settings(NamedTuple):
    """How a member's byte-level view prunes and merges its hypotheses.

    Attributes:
        beam: at most this many hypotheses are kept after each byte (>= 1).
        threshold: hypotheses below this fraction of the prefix mass are dropped
            (in [0, 1); 0: none).
        max_lag: a hypothesis back on the canonical tokens for this many tokens is
            merged into the canonical one (0: never; scoring only). Merging keeps
            the mass but not the hypothesis's own future, so no bound covers it.
    """
    beam: int
    threshold: float
    max_lag: int = 0

    def as_dict(self) -> dict:
        return self._asdict()


EXACT = Settings(beam=1 << 30, threshold=0.0, max_lag=0)
REFERENCE = Settings(beam=64, threshold=1e-6, max_lag=0)
DEFAULT = Settings(beam=16, threshold=3e-3, max_lag=2)
PRESETS = {"exact": EXACT, "reference": REFERENCE, "default": DEFAULT}

# The defaults one by one (configs and keyword defaults read these).
DEFAULT_BEAM, DEFAULT_THRESHOLD, DEFAULT_MAX_LAG = DEFAULT
