"""The harness's own command line with brf's model registered:

    python -m brf.harness run --model brf --model_args 'members=...' --tasks ... --include_path tasks

Every flag is lm-eval's (``lm-eval run --help``); this only imports brf.harness first, so
that ``--model brf`` is known.
"""

import brf.harness.lm  # noqa: F401 (registers the model 'brf')
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
