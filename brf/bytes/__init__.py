"""brf.bytes: every member as a model over bytes, exactly or with a reported pruned mass.

Three settings of one code path (`brf.bytes.lm.score_text`):

* ``EXACT``: no pruning, no merging. Every covering tokenization counts, so the
  distributions are the member's own (checked against brute-force enumeration in
  the tests); the cover grows exponentially with the text, so it is for short
  strings.
* ``REFERENCE``: a small threshold (1e-5), a wide beam (32), no merging: about 30
  forward tokens per canonical token, so for slices of a few hundred bytes. What
  the defaults are measured against (`brf.bytes.precision`, the study's precision
  check, ``check_precision`` in generation, BENCHMARKS.md). Measured against beam
  64 / threshold 1e-6 on 300-400-byte slices (Hamlet for both models, Python code
  for SmolLM2): per-byte total variation <= 2.1e-3 at the 99th percentile, bits
  per byte within 7e-5.
* ``DEFAULT``: what scoring, the study and byte-level generation use unless told
  otherwise (beam 16, threshold 3e-3, no merging); its measured distance from the
  reference is reported with every study run (several percent of total
  variation at the 99th percentile on code and on Gemma's Hamlet: BENCHMARKS.md).

Without merging every kept hypothesis is a real tokenization with its exact
probability, so the kept mass is a lower bound of the text's probability under
the member and a reported NLL lies at most the pruned log-mass (``lost``) below
the exact one. That is the only bound: a single byte's distribution, and how far
above the exact NLL a reported one lies, are measured against the reference,
not bounded.
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
REFERENCE = Settings(beam=32, threshold=1e-5, max_lag=0)
DEFAULT = Settings(beam=16, threshold=3e-3, max_lag=0)
PRESETS = {"exact": EXACT, "reference": REFERENCE, "default": DEFAULT}
# Bytes per corpus the study rescores at REFERENCE to measure DEFAULT (its precision
# check; at REFERENCE's ~30 forward tokens per canonical token, ~1-3 minutes a member).
CHECK_BYTES = 300

# The defaults one by one (configs and keyword defaults read these).
DEFAULT_BEAM, DEFAULT_THRESHOLD, DEFAULT_MAX_LAG = DEFAULT
