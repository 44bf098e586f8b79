"""brf as a model of EleutherAI's lm-evaluation-harness (``lm-eval`` 0.4.x).

``brf.harness.lm`` holds the model, :class:`BRFLM`; importing it (or naming
``brf.harness.BRFLM``) imports lm_eval and registers the model as ``brf`` in the
harness's model registry. Nothing else in brf imports lm_eval. The
model is a brf ensemble built from the specs of configs/generate.py: members (names,
GGUF files, checkpoint directories, ``random:<tokenizer>:<seed>``), a fusion method
with its parameters and phase map, weights on the members. One member is an
ensemble of one. Scoring and generation: `brf.harness.ensemble`.

Model args (``--model_args`` or ``simple_evaluate(model_args=...)``)::

    members=smollm2-135m-instruct(weight=0.5); gemma3-270m(weight=0.5),method=born,phase=tanh

The harness splits ``--model_args`` at commas, so write ``;`` wherever a brf spec
has a comma (outside quoted strings); a dict of model args takes commas as they are.
Keys: ``members`` (required), ``method`` (default ``linear``), ``phase`` ('' = the
method's), ``level`` (``auto``: tokens when the members share a vocabulary, else
bytes), ``precision`` (``default``, ``reference`` or ``exact``: `brf.bytes`'s
presets) or ``beam`` / ``threshold``, ``batch_size``, ``max_length``,
``max_gen_toks``, ``max_gen_bytes`` (byte level; default 4 x max_gen_toks), ``seed``,
``dtype``, ``speculative`` (a drafter for generate_until), ``study``
(``<study dir>:<corpus>``: the study's calibrated byte-level BRF row as the method,
`brf.harness.calibrated`).
"""

_LAZY = ("BRFLM", "ModelArgs", "NAME", "byte_summary", "commas")


def __getattr__(name):  # lm_eval is imported when the model is asked for, not before
    if name in _LAZY:
        from brf.harness import lm
        return getattr(lm, name)
    raise AttributeError(f"module 'brf.harness' has no attribute {name!r}")
