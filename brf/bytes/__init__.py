"""brf.bytes: every member as a model over bytes, exactly or with a reported pruned mass."""

# Defaults of byte-level scoring and generation: at most DEFAULT_BEAM hypotheses
# per member, none below DEFAULT_THRESHOLD of the prefix mass, and (scoring) a
# hypothesis back on the canonical tokens for DEFAULT_MAX_LAG tokens merged into
# the canonical one (BENCHMARKS.md, "Every byte", measures what other settings
# cost and change).
DEFAULT_BEAM = 16
DEFAULT_THRESHOLD = 3e-3
DEFAULT_MAX_LAG = 2
