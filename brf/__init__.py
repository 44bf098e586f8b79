"""brf: Born Rule Fusion and its baselines for language-model ensembles, in JAX."""

from brf.fusion import (FusionInputError, METHODS, PHASE_MAPS, Sampler,
                        born_terms, fuse, phase_map)

__version__ = "0.1.0"

__all__ = ["FusionInputError", "METHODS", "PHASE_MAPS", "Sampler", "born_terms",
           "fuse", "phase_map"]
