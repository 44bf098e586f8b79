"""Aligners: members' next-token logits -> log-probs over one shared event space.

Every aligner turns a list of member logits `[..., V_i]` (one array per member;
vocabularies may differ) into `Aligned.logp_XnE`, normalised log-probabilities
`[..., n, E]` over a stated event space, ready for
`brf.fuse(method, aligned.logp_XnE, weights)`. An event a member gives no mass
is -inf for it. Registered in `ALIGNERS`:

* **identity** -- members share one vocabulary (equal token-table digests);
  events are its token ids and the result is `log_softmax` of each member,
  stacked. Exact.
* **union** -- events are the union event space of `brf.align.union`: CONTROL
  plus every distinct byte string of a text token. Each member's distribution
  is mapped with one segment log-sum-exp over its index array (tokens with the
  same bytes, and all its control tokens, have their mass summed). A string the
  member has no token for gets probability 0 from it. Sums to 1 per member.
* **topk_union** -- events are the union K of the members' top-k union events
  (at most n*k slots; a duplicate slot is masked to -inf for every member and
  its `events_XE` entry is -1). Member i scores a slot s by the backoff rule:

      a = anchor_i(s)   (s itself if the member has a token for s, else its
                         longest token that is a proper prefix of s; none -> 0)
      q_i(s) = p_i(a) / #{valid slots s' in K with anchor_i(s') = a}

  i.e. the mass of each member event is shared evenly among the slots of K it
  begins; no member mass is counted twice, so `kept_i = sum_s q_i(s) <= 1` is
  the share of member i's distribution that K keeps (reported). The output is
  q_i / kept_i, which sums to 1 over the valid slots. A member's own top-1
  event is in K and anchors to itself, so kept_i > 0.

The maps are pure jitted functions of arrays; tables are built once per member
set (`brf.align.union.union_table`) and bound by `make_aligner`.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.align.union import CONTROL, UnionTable, union_table
from brf.align.vocab import TokenTable
from brf.registry import Registry


class Aligned(NamedTuple):
    """Members' distributions over one event space.

    Attributes:
        logp_XnE: log-probabilities [..., n, E], each member normalised over E
            (the valid events); -inf where a member gives no mass.
        events_XE: int32 event ids of the columns: token ids (identity), union
            event ids (union: [E] = arange(U); topk_union: [..., M] with -1 for
            masked duplicate slots).
        info: diagnostics: 'control_mass_Xn' (member mass on CONTROL; union and
            topk_union), 'kept_Xn' (topk_union: member mass kept by K).
    """

    logp_XnE: jax.Array
    events_XE: jax.Array
    info: dict


# ----------------------------------------------------------------------------- kernels

def segment_logsumexp(logp_XV: jax.Array, index_V: jax.Array, num_segments: int) -> jax.Array:
    """log sum_{t: index[t] = u} exp(logp[..., t]) for every segment u (exact in log space).

    Subtracts each segment's own max before exponentiating, so a segment whose
    log-probs are far below the distribution's max (e.g. -200) is not lost to
    underflow. Empty segments give -inf.

    Args:
        logp_XV: [..., V] log-probs (or any log-weights; -inf allowed).
        index_V: int [V], segment of each column, in [0, num_segments).
        num_segments: U (static).

    Returns:
        [..., U].
    """
    x_VX = jnp.moveaxis(logp_XV, -1, 0)
    m_UX = jax.ops.segment_max(x_VX, index_V, num_segments)
    m_UX = jnp.where(jnp.isfinite(m_UX), m_UX, 0.0)  # empty / all -inf segments
    s_UX = jax.ops.segment_sum(jnp.exp(x_VX - m_UX[index_V]), index_V, num_segments)
    out_UX = jnp.where(s_UX > 0, jnp.log(jnp.where(s_UX > 0, s_UX, 1.0)) + m_UX, -jnp.inf)
    return jnp.moveaxis(out_UX, 0, -1)


@functools.partial(jax.jit, static_argnames=("num_events",))
def union_logprobs(logits: tuple[jax.Array, ...], index: tuple[jax.Array, ...],
                   num_events: int) -> jax.Array:
    """Members' logits -> log-probs over the union events, [..., n, U].

    Args:
        logits: per member [..., V_i] logits (leading shapes equal).
        index: per member int32 [V_i] token -> event.
        num_events: U.
    """
    out = []
    for l, ix in zip(logits, index):
        logp = jax.nn.log_softmax(l.astype(jnp.result_type(l, jnp.float32)), axis=-1)
        out.append(segment_logsumexp(logp, ix, num_events))
    return jnp.stack(out, axis=-2)


@functools.partial(jax.jit, static_argnames=("k",))
def topk_union_logprobs(logp_XnU: jax.Array, anchor_nU: jax.Array, k: int):
    """The top-k union with the shared-anchor backoff rule (see the module docstring).

    Args:
        logp_XnU: members' union log-probs [..., n, U] (from `union_logprobs`).
        anchor_nU: int32 [n, U] backoff anchors (`UnionTable.anchor_nU`).
        k: each member's number of top events (static).

    Returns:
        (logp_XnM, events_XM, kept_Xn): M = n*k slots; masked duplicate slots
        have event -1 and log-prob -inf; kept_Xn is the mass each member had
        on K before renormalising.
    """
    n, num_events = logp_XnU.shape[-2:]
    k = min(k, num_events)
    _, top_XnK = jax.lax.top_k(logp_XnU, k)
    ids_XM = top_XnK.reshape(*top_XnK.shape[:-2], n * k)
    m = n * k
    earlier_MM = jnp.tril(jnp.ones((m, m), bool), -1)  # [slot, other]: other < slot
    dup_XM = jnp.any((ids_XM[..., :, None] == ids_XM[..., None, :]) & earlier_MM, axis=-1)
    valid_XM = ~dup_XM
    anchor_XnM = jnp.moveaxis(anchor_nU[:, ids_XM], 0, -2)
    has_anchor = anchor_XnM >= 0
    base_XnM = jnp.take_along_axis(logp_XnU, jnp.where(has_anchor, anchor_XnM, 0), axis=-1)
    same_XnMM = (anchor_XnM[..., :, None] == anchor_XnM[..., None, :]) \
        & valid_XM[..., None, None, :]
    count_XnM = jnp.maximum(same_XnMM.sum(-1), 1).astype(logp_XnU.dtype)
    ok_XnM = has_anchor & valid_XM[..., None, :]
    logq_XnM = jnp.where(ok_XnM, base_XnM - jnp.log(count_XnM), -jnp.inf)
    logkept_Xn = jax.nn.logsumexp(logq_XnM, axis=-1)
    logp_XnM = logq_XnM - logkept_Xn[..., None]
    return logp_XnM, jnp.where(valid_XM, ids_XM, -1), jnp.exp(logkept_Xn)


# ----------------------------------------------------------------------------- aligners

class Aligner(NamedTuple):
    """A registered aligner.

    Attributes:
        name: its registry name.
        build: (token tables, cache_dir) -> the table it needs, built once.
        apply: (table, logits per member, **params) -> Aligned.
        params: the names of its keyword parameters.
    """

    name: str
    build: Callable[[Sequence[TokenTable], Any], Any]
    apply: Callable[..., Aligned]
    params: tuple[str, ...] = ()


ALIGNERS: Registry[Aligner] = Registry("vocabulary aligner")


def _check_logits(logits: Sequence[jax.Array], sizes: Sequence[int]) -> tuple[jax.Array, ...]:
    logits = tuple(jnp.asarray(l) for l in logits)
    if len(logits) != len(sizes):
        raise ValueError(f"got logits for {len(logits)} members, the aligner was built for "
                         f"{len(sizes)}")
    for i, (l, v) in enumerate(zip(logits, sizes)):
        if l.ndim < 1 or l.shape[-1] != v:
            raise ValueError(f"member {i}: logits of shape {l.shape}, vocabulary size {v}")
        if l.shape[:-1] != logits[0].shape[:-1]:
            raise ValueError(f"member {i}: leading shape {l.shape[:-1]} differs from member 0's "
                             f"{logits[0].shape[:-1]}")
    return logits


class IdentityTable(NamedTuple):
    """The shared vocabulary of identity-aligned members (its TokenTable)."""

    tokens: TokenTable

    @property
    def size(self) -> int:
        return self.tokens.size


def _identity_build(tables: Sequence[TokenTable], cache_dir=None) -> IdentityTable:
    digests = {t.digest for t in tables}
    if len(digests) != 1:
        raise ValueError("the identity aligner needs members with one vocabulary; their token "
                         f"tables differ ({len(digests)} digests). Use 'union' or 'topk_union'")
    return IdentityTable(tables[0])


def _identity_apply(table: IdentityTable, logits: Sequence[jax.Array]) -> Aligned:
    logits = _check_logits(logits, [table.size] * len(logits))
    logp = jax.nn.log_softmax(jnp.stack(logits, axis=-2), axis=-1)
    return Aligned(logp, jnp.arange(table.size, dtype=jnp.int32), {})


class DeviceUnion(NamedTuple):
    """A UnionTable plus its arrays on device (what the jitted maps take)."""

    table: UnionTable
    index: tuple[jax.Array, ...]
    anchor_nU: jax.Array


def _union_build(tables: Sequence[TokenTable], cache_dir=None) -> DeviceUnion:
    table = union_table(tables, cache_dir)
    return DeviceUnion(table, tuple(jnp.asarray(ix) for ix in table.index),
                       jnp.asarray(table.anchor_nU))


def _union_apply(dev: DeviceUnion, logits: Sequence[jax.Array]) -> Aligned:
    logits = _check_logits(logits, [len(ix) for ix in dev.table.index])
    logp = union_logprobs(logits, dev.index, num_events=dev.table.size)
    info = {"control_mass_Xn": jnp.exp(logp[..., CONTROL])}
    return Aligned(logp, jnp.arange(dev.table.size, dtype=jnp.int32), info)


def _topk_union_apply(dev: DeviceUnion, logits: Sequence[jax.Array], k: int = 16) -> Aligned:
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"topk_union: k must be a positive int, got {k!r}")
    logits = _check_logits(logits, [len(ix) for ix in dev.table.index])
    full = union_logprobs(logits, dev.index, num_events=dev.table.size)
    logp, events, kept = topk_union_logprobs(full, dev.anchor_nU, k=int(k))
    info = {"control_mass_Xn": jnp.exp(full[..., CONTROL]), "kept_Xn": kept}
    return Aligned(logp, events, info)


ALIGNERS.add("identity", Aligner("identity", _identity_build, _identity_apply))
ALIGNERS.add("union", Aligner("union", _union_build, _union_apply))
ALIGNERS.add("topk_union", Aligner("topk_union", _union_build, _topk_union_apply, ("k",)))


class Alignment(NamedTuple):
    """An aligner bound to its built table: call it with the members' logits.

    Attributes:
        aligner: the registry entry.
        table: what `aligner.build` returned (IdentityTable / DeviceUnion).
    """

    aligner: Aligner
    table: Any

    def __call__(self, logits: Sequence[jax.Array], **params: Any) -> Aligned:
        unknown = set(params) - set(self.aligner.params)
        if unknown:
            raise ValueError(f"aligner {self.aligner.name!r} has no parameter(s) "
                             f"{sorted(unknown)}; it takes {list(self.aligner.params)}")
        return self.aligner.apply(self.table, logits, **params)

    @property
    def union(self) -> UnionTable | None:
        """The UnionTable (union aligners), else None."""
        return getattr(self.table, "table", None)

    def event_bytes(self, event: int) -> bytes:
        """The text an event stands for (b"" for control events)."""
        if isinstance(self.table, IdentityTable):
            return self.table.tokens.token_bytes[int(event)]
        return self.table.table.strings[int(event)]

    def is_control(self, event: int) -> bool:
        """True for control events (generation stops there)."""
        if isinstance(self.table, IdentityTable):
            return bool(self.table.tokens.control_V[int(event)])
        return int(event) == CONTROL


def make_aligner(name: str, tables: Sequence[TokenTable],
                 cache_dir: str | os.PathLike | None = None) -> Alignment:
    """Builds (once; cached per member set) the aligner `name` for these members.

    Args:
        name: 'identity', 'union', 'topk_union' (`ALIGNERS.names()`).
        tables: the members' TokenTables (`brf.align.token_table(tokenizer)`).
        cache_dir: optional directory for the union table .npz cache.

    Returns:
        An Alignment; `alignment([logits_0, ..., logits_{n-1}], **params)`.
    """
    aligner = ALIGNERS.get(name)
    return Alignment(aligner, aligner.build(list(tables), cache_dir))


__all__ = ["ALIGNERS", "Aligned", "Aligner", "Alignment", "IdentityTable", "make_aligner",
           "segment_logsumexp", "topk_union_logprobs", "union_logprobs"]
