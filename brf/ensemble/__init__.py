"""brf.ensemble: members, the decoding loop, mixture sampling, lazy cache catch-up.

Entry points: :func:`generate` / :func:`stream` (brf/ensemble/decode.py) over a
list of :class:`Member` (brf/ensemble/member.py).
"""

from brf.ensemble.catchup import MemberState, bucket, catch_up
from brf.ensemble.decode import (CHOICES, MODES, Generation, Piece, generate, make_space,
                                 stream)
from brf.ensemble.member import (EnsembleInputError, Member, from_model,
                                 normalised_weights)

__all__ = ["CHOICES", "EnsembleInputError", "Generation", "MODES", "Member", "MemberState",
           "Piece", "bucket", "catch_up", "from_model", "generate", "make_space",
           "normalised_weights", "stream"]
