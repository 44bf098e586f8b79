"""The ensemble decoding loop: fuse or mix members token by token, emit text.

Modes (each named for the distribution it samples):

* ``fuse``: every member runs every step; their aligned distributions are
  fused with a registered method (``brf.fusion.METHODS``) and the sampler
  (greedy, temperature, top-k, top-p, min-p) is applied to the *fused*
  distribution.
* ``mixture_exact``: mixture sampling (ME). One member k ~ Categorical(w) per
  sequence per step runs; the next event is drawn from its distribution at
  temperature 1 with no truncation. This samples the linear pool
  ``sum_i w_i p_i`` exactly while running one member per step. A sampler other
  than plain sampling is refused: it would silently change the distribution.
* ``mixture_per_member``: ME with the sampler applied to the chosen member's
  distribution before mixing, i.e. it samples ``sum_i w_i filter(p_i)`` — in
  general *not* ``filter(sum_i w_i p_i)`` (that is ``fuse`` with
  ``method='linear'``).

Members not run at a step only accumulate pending tokens and catch up in one
forward pass when next needed (:mod:`brf.ensemble.catchup`). In the mixture
modes each sequence picks its own member (``choice='per_sequence'``, so the
sequences of a batch are independent draws; a step runs the members any
sequence picked) or the batch shares one pick per step (``choice='shared'``:
exactly one member runs per step, the ME speedup for batches; every sequence
is still an exact draw, but the sequences are correlated).

Reproducibility: step t of a run with ``seed`` uses ``fold_in(PRNGKey(seed), t)``
split into a member-choice key and a token key; the same seed, members,
prompts and settings give the same text.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.ensemble import catchup
from brf.ensemble.member import (EnsembleInputError, Member, check_prompt_fits,
                                 normalised_weights)
from brf.ensemble.space import IdentitySpace
from brf.ensemble.text import TextStream
from brf.fusion import METHODS, FusionInputError, Sampler, fuse
from brf.fusion import methods as fusion_methods
from brf.fusion.mixture import select_member
from brf.fusion.sampling import filter_logprobs
from brf.fusion.sampling import sample as _sample

MODES = ("fuse", "mixture_exact", "mixture_per_member")
CHOICES = ("per_sequence", "shared")


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of streamed text.

    Attributes:
        index: which prompt of the batch it belongs to.
        text: new text (may be empty when only ``finished`` is news).
        finished: None while the sequence runs; then its finish reason:
            'stop' (a stop string), 'eos' (a member's end-of-sequence token),
            'length' (max_new_tokens) or 'context' (a member's context is full).
    """
    index: int
    text: str
    finished: str | None = None


@dataclasses.dataclass
class Generation:
    """The result for one prompt.

    Attributes:
        prompt: the prompt text.
        text: the generated text (stop string excluded).
        finish_reason: see :class:`Piece`.
        n_events: events (tokens of the shared space) generated.
        members_run: per member, at how many steps it ran for this sequence
            (catch-ups included; fuse mode: every step).
        trace: per step, a dict with 'logq' ([U] numpy log-probs: the fused
            distribution in mode 'fuse', before the sampler; the chosen member's
            distribution, after the sampler in 'mixture_per_member'), 'member_logp' ({member index:
            [U] aligned log-probs} for the members that ran), 'event' and
            'member' (ME only); empty unless ``trace=True``.
    """
    prompt: str
    text: str = ""
    finish_reason: str | None = None
    n_events: int = 0
    members_run: list[int] = dataclasses.field(default_factory=list)
    trace: list[dict] = dataclasses.field(default_factory=list)


@functools.partial(jax.jit, static_argnames=("sampler",))
def _draw(key, logq_BxU, sampler):
    return _sample(key, logq_BxU, sampler)


@functools.partial(jax.jit, static_argnames=("sampler",))
def _filtered(logq_BxU, sampler):
    return filter_logprobs(logq_BxU, sampler)


@jax.jit
def _pick_rows(logp_NxBxU, member_B):
    return jnp.take_along_axis(logp_NxBxU, member_B[None, :, None], axis=0)[0]


def _check_method(method: str, params: Mapping[str, Any], n: int) -> None:
    try:
        m = fusion_methods.get_method(method)
        fusion_methods.resolve_params(m, dict(params))
    except FusionInputError as e:
        raise EnsembleInputError(str(e)) from None
    # A dry run on a tiny input catches per-member parameter shapes (phase offsets).
    try:
        fuse(method, jnp.zeros((n, 2)), jnp.full((n,), 1.0 / n), **params)
    except FusionInputError as e:
        raise EnsembleInputError(f"fusion method {method!r} with {dict(params)}: {e}") from None


def make_space(aligner: str | Callable, members: Sequence[Member], batch: int):
    """The event space for ``aligner`` ('identity', a brf.align name, or a factory)."""
    if callable(aligner):
        return aligner(members, batch)
    if aligner == "identity":
        return IdentitySpace(members, batch)
    from brf.ensemble import aligned  # needs brf.align
    return aligned.AlignedSpace(aligner, members, batch)


def stream(members: Sequence[Member], prompts: Sequence[str], *,
           weights: Sequence[float] | None = None, mode: str = "fuse",
           method: str = "linear", method_params: Mapping[str, Any] | None = None,
           sampler: Sampler | str | None = None, max_new_tokens: int = 64,
           stop: Sequence[str] = (), seed: int = 0, aligner: str | Callable = "identity",
           choice: str = "per_sequence", dtype=jnp.float32,
           results: list[Generation] | None = None, trace: bool = False
           ) -> Iterator[Piece]:
    """Generates text for a batch of prompts, yielding pieces as they become final.

    All input checks run when this is called, before any model runs and before
    the first piece is asked for.

    Args:
        members: the ensemble (:class:`brf.ensemble.member.Member`).
        prompts: B prompt strings.
        weights: one weight per member summing to 1 (default: the members'
            own weights, else uniform).
        mode: 'fuse' | 'mixture_exact' | 'mixture_per_member' (module docstring).
        method: fusion method for mode 'fuse' (``brf.fusion.METHODS``).
        method_params: its parameters, e.g. ``{'phase': 'tanh(rate=0.5)'}``.
        sampler: a Sampler or its string form ('greedy', 'temperature=0.7,top_p=0.9').
        max_new_tokens: events per sequence at most.
        stop: stop strings (the text is cut before the first one).
        seed: PRNG seed.
        aligner: 'identity' (shared vocabulary) or a vocabulary aligner name.
        choice: mixture modes: 'per_sequence' or 'shared' (module docstring).
        dtype: compute dtype of the members.
        results: if given, filled with one :class:`Generation` per prompt.
        trace: record per-step distributions into the results (tests).

    Yields:
        :class:`Piece` objects, in step order.
    """
    members = list(members)
    prompts = list(prompts)
    sampler = Sampler.parse(sampler) if not isinstance(sampler, Sampler) else sampler
    method_params = dict(method_params or {})
    if mode not in MODES:
        raise EnsembleInputError(f"unknown mode {mode!r}; use one of {MODES}")
    if choice not in CHOICES:
        raise EnsembleInputError(f"unknown choice {choice!r}; use one of {CHOICES}")
    if not prompts:
        raise EnsembleInputError("no prompts")
    if max_new_tokens < 1:
        raise EnsembleInputError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    w = normalised_weights(members, weights)
    if mode == "fuse":
        _check_method(method, method_params, len(members))
    elif method != "linear" or method_params:
        raise EnsembleInputError(f"mode {mode!r} mixes members (a linear pool); it takes no "
                                 f"fusion method (got method={method!r}, params={method_params})")
    if mode == "mixture_exact" and sampler != Sampler():
        raise EnsembleInputError(
            f"mode 'mixture_exact' samples the linear pool exactly only at temperature 1 "
            f"without truncation; got {sampler}. Use mode='mixture_per_member' (sampler "
            f"applied to each member before mixing) or mode='fuse' with method='linear' "
            f"(sampler applied to the pool)")
    B = len(prompts)
    space = make_space(aligner, members, B)
    same_vocab = isinstance(space, IdentitySpace)
    prompt_ids = [[m.prompt_ids(p) for p in prompts] for m in members]
    for m, ids in zip(members, prompt_ids):
        for p in ids:
            check_prompt_fits(m, p, max_new_tokens if same_vocab else 0)
    return _run(members, prompts, w, mode, method, method_params, sampler, max_new_tokens,
                tuple(stop), seed, space, choice, dtype, results, trace, prompt_ids)


def _run(members, prompts, w, mode, method, method_params, sampler, max_new_tokens, stop,
         seed, space, choice, dtype, results, trace, prompt_ids) -> Iterator[Piece]:
    n, B = len(members), len(prompts)
    gens = [Generation(prompt=p, members_run=[0] * n) for p in prompts]
    if results is not None:
        results[:] = gens
    streams = [TextStream(stop) for _ in range(B)]
    # Room for the prompt bucket plus twice the expected tokens (catch-up padding).
    states = [catchup.start(m, ids, dtype=dtype,
                            slots=catchup.bucket(max(map(len, ids)), 8) + 2 * max_new_tokens)
              for m, ids in zip(members, prompt_ids)]
    done = [False] * B
    w_dev = jnp.asarray(w, jnp.float32)
    base = jax.random.PRNGKey(seed)

    for step in range(max_new_tokens):
        live = [b for b in range(B) if not done[b]]
        if not live:
            break
        k_member, k_token = jax.random.split(jax.random.fold_in(base, step))
        if mode == "fuse":
            needed = list(range(n))
            member_B = None
        else:
            if choice == "shared":
                member_B = np.full(B, int(select_member(k_member, w_dev)), np.int32)
            else:
                member_B = np.asarray(select_member(k_member, jnp.broadcast_to(w_dev, (B, n))))
            needed = sorted({int(member_B[b]) for b in live})
        logp = {}
        for i in needed:
            states[i] = catchup.catch_up(members[i], states[i], dtype=dtype)
            logp[i] = space.aligned(i, states[i].logits_BxV)
            for b in live:
                gens[b].members_run[i] += 1
        if mode == "fuse":
            logq_BxU = fuse(method, jnp.stack([logp[i] for i in range(n)], axis=1), w_dev,
                            validate=False, **method_params)
            event_B = _draw(k_token, logq_BxU, sampler)
        else:
            if len(needed) == 1:
                rows_BxU = logp[needed[0]]
            else:
                stacked = jnp.stack([logp.get(i, logp[needed[0]]) for i in range(n)])
                rows_BxU = _pick_rows(stacked, jnp.asarray(member_B))
            s = sampler if mode == "mixture_per_member" else Sampler()
            event_B = _draw(k_token, rows_BxU, s)
            logq_BxU = rows_BxU if s == Sampler() else _filtered(rows_BxU, s)
        event_B = np.asarray(event_B)
        if trace:
            logq_np = np.asarray(logq_BxU)
            logp_np = {i: np.asarray(v) for i, v in logp.items()}
        # Host side: text, stop conditions, re-encoding into pending tokens.
        new = [[[] for _ in range(B)] for _ in range(n)]
        for b in live:
            e = int(event_B[b])
            g = gens[b]
            if trace:
                g.trace.append(dict(logq=logq_np[b], event=e,
                                    member_logp={i: v[b] for i, v in logp_np.items()},
                                    member=None if member_B is None else int(member_B[b])))
            g.n_events += 1
            reason, piece = None, ""
            if space.is_eos(e):
                reason = "eos"
            else:
                space.choose(b, e)
                for i in range(n):
                    new[i][b] = space.tokens_for(b, e, i)
                piece = streams[b].update(space.text(b))
                if streams[b].stopped:
                    reason = "stop"
                elif g.n_events >= max_new_tokens:
                    reason = "length"
                elif any(states[i].n_read[b] + len(states[i].pending[b]) + len(new[i][b])
                         >= members[i].cfg.max_seq_len for i in range(n)):
                    reason = "context"
            if reason is not None:
                piece += streams[b].update(space.text(b), final=True)
                done[b] = True
                g.finish_reason = reason
                for i in range(n):
                    new[i][b] = []
            g.text = streams[b].text
            if piece or reason:
                yield Piece(b, piece, reason)
        states = [catchup.add_pending(s, new[i]) for i, s in enumerate(states)]


def generate(members: Sequence[Member], prompts: Sequence[str], *,
             on_piece: Callable[[Piece], None] | None = None, **kwargs) -> list[Generation]:
    """Generates text for every prompt; see :func:`stream` for the arguments.

    Args:
        members: the ensemble.
        prompts: B prompt strings.
        on_piece: called with every :class:`Piece` as it becomes final (streaming).
        **kwargs: the keyword arguments of :func:`stream`.

    Returns:
        One :class:`Generation` per prompt.
    """
    results: list[Generation] = []
    for piece in stream(members, prompts, results=results, **kwargs):
        if on_piece is not None:
            on_piece(piece)
    return results
