"""brf: Born Rule Fusion and its baselines for language-model ensembles, in JAX."""

# First, before JAX loads: in brf's own mains (experiments/*.py) Ctrl-C from here on
# ends in one line, exit status 130 (brf.interrupts); any other program is left alone.
from brf import interrupts as _interrupts

_interrupts.install_for_main()

from brf.fusion import (FusionInputError, METHODS, PHASE_MAPS, Sampler,  # noqa: E402
                        born_terms, fuse, phase_map)

__version__ = "0.1.0"

__all__ = ["FusionInputError", "METHODS", "PHASE_MAPS", "Sampler", "born_terms",
           "fuse", "phase_map"]
