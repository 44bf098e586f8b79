"""brf.fusion: pure, jit-compiled kernels that fuse members' distributions.

Entry points: :func:`fuse`, and :func:`compile` for a method whose parameters
are parsed once (a :class:`Fuser`). Registries: :data:`METHODS` (fusion methods),
:data:`PHASE_MAPS` (Born phase maps).
"""

from brf.fusion.api import TRACE_COUNTS, Fuser, compile, fuse  # noqa: A004
from brf.fusion.born import BornTerms, born, born_terms
from brf.fusion.checks import FusionInputError
from brf.fusion.methods import METHODS, Method, Param, get_method
from brf.fusion.mixture import mixture_logprobs, mixture_sample, select_member
from brf.fusion.phase import PHASE_MAPS, PhaseMap, phase_map, position_gap
from brf.fusion.pools import entropy, linear_pool
from brf.fusion.sampling import Sampler, filter_logprobs, sample
from brf.fusion.weights import perplexity_weights, softmax_weights

__all__ = [
    "BornTerms", "Fuser", "FusionInputError", "METHODS", "Method", "PHASE_MAPS", "Param",
    "PhaseMap", "Sampler", "TRACE_COUNTS", "born", "born_terms", "compile", "entropy",
    "filter_logprobs", "fuse", "get_method", "linear_pool", "mixture_logprobs",
    "mixture_sample", "perplexity_weights", "phase_map", "position_gap",
    "sample", "select_member", "softmax_weights",
]
