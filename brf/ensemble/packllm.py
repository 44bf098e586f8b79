"""PackLLM-style member weights: each member's perplexity on the prompt.

PackLLM (Mavromatis et al., 2024) weights the members of an ensemble, per
prompt, by how well each one predicts that prompt: ``w_i ∝ exp(-log PPL_i / tau)``
(:func:`brf.fusion.perplexity_weights`). A member that finds the prompt
surprising gets less weight.

What is scored here: each member reads its own conditioning text (its
``prefix``, after BOS where its tokenizer adds one) followed by the prompt as
plain text, and ``log PPL_i`` is its mean negative log-likelihood over the
prompt's tokens (those after the longest token prefix shared with the
conditioning text alone). Chat templates are not applied: the template's
formatting tokens would be scored too and say nothing about the prompt. Members
with different tokenizers are compared per token, as PackLLM does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from brf.align.vocab import encode_text
from brf.ensemble.member import EnsembleInputError, Member
from brf.fusion.weights import perplexity_weights
from brf.models.scoring import score_tokens


def _conditioning_split(m: Member, prompt: str) -> tuple[list[int], int]:
    tok = m.tokenizer
    full = encode_text(tok, m.prefix + prompt, add_special_tokens=True)
    ctx = encode_text(tok, m.prefix, add_special_tokens=True)
    n = 0
    while n < min(len(full), len(ctx)) and full[n] == ctx[n]:
        n += 1
    return full, max(n, 1)


def prompt_nll(members: Sequence[Member], prompts: Sequence[str]) -> np.ndarray:
    """Mean NLL (nats per prompt token) of every member on every prompt.

    Each member scores all prompts in one padded batch (length rounded up to a
    power of two, so prompts of similar length share one compilation).

    Returns:
        float64 [len(prompts), len(members)].

    Raises:
        EnsembleInputError: a prompt that leaves a member no token to score, or
            that does not fit a member's context.
    """
    out = np.zeros((len(prompts), len(members)))
    for i, m in enumerate(members):
        splits = [_conditioning_split(m, p) for p in prompts]
        for (ids, n_ctx), p in zip(splits, prompts):
            if len(ids) <= n_ctx:
                raise EnsembleInputError(f"member {m.name!r}: the prompt {p[:40]!r} has no "
                                         "tokens of its own to score for perplexity weights")
            if len(ids) > m.cfg.max_seq_len:
                raise EnsembleInputError(f"member {m.name!r}: prefix + prompt is {len(ids)} "
                                         f"tokens, longer than its context {m.cfg.max_seq_len}")
        n_max = max(len(ids) for ids, _ in splits)
        length = min(max(16, 1 << (n_max - 1).bit_length()), m.cfg.max_seq_len)
        tokens = np.zeros((len(prompts), length), np.int32)
        valid = np.zeros((len(prompts), length), bool)
        for b, (ids, _) in enumerate(splits):
            tokens[b, :len(ids)] = ids
            valid[b, :len(ids)] = True
        logp_BxT = score_tokens(m.params, m.cfg, tokens, valid, chunk=min(length, 256))
        for b, (ids, n_ctx) in enumerate(splits):
            out[b, i] = -float(np.mean(logp_BxT[b, n_ctx - 1:len(ids) - 1]))
    return out


def perplexity_weight_table(members: Sequence[Member], prompts: Sequence[str],
                            temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """PackLLM weights per prompt.

    Args:
        members: the ensemble.
        prompts: B prompts.
        temperature: tau > 0; small picks the least perplexed member, large is uniform.

    Returns:
        (weights [B, n] float64 on the simplex, mean NLL per prompt token [B, n]).
    """
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise EnsembleInputError(f"perplexity weights: temperature must be > 0; "
                                 f"got {temperature!r}")
    nll = prompt_nll(members, prompts)
    w = np.asarray(perplexity_weights(nll, temperature), np.float64)
    return w / w.sum(axis=1, keepdims=True), nll  # float32 softmax -> exact simplex
