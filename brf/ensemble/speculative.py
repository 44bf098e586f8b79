"""Speculative fused decoding (issue 40): the fused distribution, fewer forward steps.

Plain fused decoding (:mod:`brf.ensemble.decode`, mode ``fuse``) runs every
member at every token. Here a *drafter* proposes up to k tokens, every member
reads the whole draft in one forward call over its KV cache (a prefill of the
draft with every position's logits), the fused distribution is computed at each
drafted position and the one after, and the accept / resample step of
speculative sampling (:mod:`brf.fusion.speculative`) keeps the text's law
exactly that of plain fused decoding: the target at each position is the
*sampler's* distribution of the fused one (temperature, top-k, top-p, min-p
applied to the fusion), and greedy decoding emits the fused argmax sequence.
A round emits between 1 and k + 1 tokens.

**Drafters** (a spec string, `brf.drafting.parse_drafter`):

* ``member(k=4, index=i)``: member i's model under its own prefix drafts k tokens
  autoregressively from its own distribution with the run's sampler applied
  (default: the smallest member). It keeps its own KV cache; after a round it
  is rolled back to the accepted text.
* ``ngram(n=3, k=6, min_n=1)``: no model. The continuation of the most recent
  earlier occurrence of the last n tokens of the context (prompt ids, template
  included, and the generated tokens), trying n, n - 1, .., min_n; no draft when
  nothing matches (the round is a plain step). Deterministic: a draft token is
  accepted with probability q(x).
* ``adaptive=True`` (either drafter): k is the most a round drafts; a round whose
  drafts were all accepted drafts two more next time, one with a rejection one
  fewer (at least 1).
* ``cost=c``: what a drafted token costs as a share of a plain step (below).

**Drafting only where it pays** (`brf.drafting.KSchedule`). A round costs more
than a plain step (it runs on the host, verifies its draft, and a member drafter
runs its own steps), so drafts must be accepted often enough to pay for it. The
schedule follows the acceptance and drafts the k with the most tokens per unit of
cost, or nothing when no k beats a plain step. While drafting is paused the loop
runs plain fused steps as compiled blocks of :data:`PAUSED_BLOCK` (rounds that
draft nothing: the program :func:`brf.ensemble.decode.generate` runs; members
that share weights are split out of their batch for it and joined again after),
on either engine, through the device engine's block (:meth:`_Loop._device_block`),
so text that defeats the
drafter decodes at plain decoding's speed; the n-gram drafter's would-be drafts
are checked against each emitted token for free, and drafting resumes once they
would be accepted often enough. A member drafter that costs a whole step (as
large as the models it drafts for) never drafts.

**Rolling back.** A member's cache slots hold token positions (``brf.models.cache``):
after a round every slot whose position is at or past the accepted length is
marked empty (-1, never attended to again), ``next_pos`` is set back, and the
write pointer returns to just past the last slot still in use, so rejected
draft tokens are never visible and their slots are reused.

**Members that share weights** (the prompt ensemble: one model under two system
prompts) are read as one batch by default (``group=True``): one verification
call per model, not per member.

**Engines.** The rounds run on the host (a dispatch per stage, the verdicts read
back), or as compiled blocks of rounds on the device (``engine='device'``,
:func:`brf.ensemble.step.run_rounds`: drafting (a member drafter's steps too),
verification, rollback and the schedule's choice of k, with nothing read back
until the block ends). Both engines verify with the same functions and draw
the same random numbers (round t, paused steps counted, draws with the key
``fold_in(PRNGKey(seed), t)``), so for one seed they give the same text and
statistics, sampled as greedy (up to float rounding between their forward
passes). ``engine='auto'`` uses the device's rounds when the members are on an
accelerator; on a CPU the host's measured as fast.

Token level only for members that share one vocabulary (``aligner='identity'``);
members with different tokenizers speculate on bytes (:mod:`brf.bytes.speculative`).
Randomness: JAX keys, round t (a paused plain step is a round) drawing with
``fold_in(PRNGKey(seed), t)`` split as plain decoding's step t splits it, so the
same seed gives the same text on either engine; the text follows the same law as
plain fused decoding, not the same draws (a generation that never drafts is plain
decoding's text for the seed).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.ensemble import catchup
from brf.ensemble import step as dstep
from brf.ensemble.decode import (ENGINES, Generation, Piece, _check_method,
                                 _check_request, _colocated, _gatherer, _with_unembeddings)
from brf.ensemble.member import (EnsembleInputError, Member, check_prompt_fits,
                                 normalised_weights)
from brf.ensemble.space import IdentitySpace
from brf.drafting import (DECAY, DraftSpec, KSchedule, SpecStats, drafter_index, ngram_draft,
                          param_count, parse_drafter)
from brf.fusion import Sampler, fuse
from brf.fusion.speculative import Verdict, verify_greedy
from brf.models import cache as model_cache
from brf.models.transformer import prefill_donated
from brf.text import TextStream

# Plain steps a paused generation runs per compiled block (brf.drafting.KSchedule): the
# schedule looks at what the block emitted before the next one.
PAUSED_BLOCK = 16
# Drafting rounds a compiled block runs at most (n-gram rounds on the device); it
# ends sooner where the schedule would pause.
ROUND_BLOCK = 16

# ----------------------------------------------------------------------------- device pieces

# the member drafter's draw and the accept / resample step: the device rounds' own
# functions, so both engines draw the same random numbers
_draft_draw = jax.jit(dstep.draft_draw, static_argnames=("sampler",))
_accept_sampled = jax.jit(dstep.accept_sampled, static_argnames=("sampler",))


@jax.jit
def _gather_rows(old_RxV, all_RxTxV, idx_RxK):
    """Rows idx of concat(old[:, None], all) along T: [R, K, V]."""
    both = jnp.concatenate([old_RxV[:, None], all_RxTxV], axis=1)
    return jnp.take_along_axis(both, idx_RxK[:, :, None], axis=1)


@jax.jit
def _log_softmax(x):
    return jax.nn.log_softmax(x, axis=-1)


_rollback_slots = jax.jit(dstep.rollback_slots)


def rollback(state: catchup.MemberState, n_read: Sequence[int],
             pending: Sequence[Sequence[int]]) -> catchup.MemberState:
    """The state with each row cut back to its first ``n_read[b]`` tokens (slots of
    later positions emptied, never attended to again) and ``pending`` to read next.
    When no row is cut back (a round that read no draft) the cache is left as it is."""
    if tuple(int(n) for n in n_read) == tuple(state.n_read):
        return state._replace(pending=tuple(tuple(p) for p in pending))
    c = state.cache
    next_pos = jnp.asarray(np.asarray(n_read, np.int32))
    pos, end = _rollback_slots(c["pos"], next_pos)
    end_host = int(end)
    cache = dict(c, pos=pos, next_pos=next_pos, end=jnp.asarray(end_host, jnp.int32))
    return catchup.MemberState(cache, state.logits_BxV, tuple(tuple(p) for p in pending),
                               end_host, tuple(int(n) for n in n_read))


def read_all(member, state: catchup.MemberState, tokens: Sequence[Sequence[int]], *,
             dtype) -> tuple[jax.Array | None, catchup.MemberState]:
    """Every row reads its tokens (ragged, right-padded) in one call; returns the
    logits after every position ([R, T, V], None when nothing is read) and the
    state with them read (nothing pending)."""
    lengths = [len(t) for t in tokens]
    T = max(lengths, default=0)
    if T == 0:
        return None, state._replace(pending=((),) * len(lengths))
    cache = state.cache
    S = cache["pos"].shape[1]
    if state.end + T > S:
        cache = model_cache.grow(cache, catchup.bucket(state.end + T))
    toks, valid = catchup._padded(tokens, T, 0)
    mesh = catchup._data_mesh(member.params, len(lengths))
    from brf import sharding
    logits, cache = prefill_donated(member.params, member.cfg,
                                    sharding.shard_batch(jnp.asarray(toks), mesh),
                                    sharding.shard_batch(jnp.asarray(valid), mesh), cache,
                                    dtype=jnp.dtype(dtype), logits="all")
    n_read = tuple(n + k for n, k in zip(state.n_read, lengths))
    return logits, catchup.MemberState(cache, state.logits_BxV, ((),) * len(lengths),
                                       state.end + T, n_read)


def _round_room(cfg, cache: dict, end: int, n_read, k: int, horizon: int):
    """``(cache, reads, span)`` of a cache for a block of device rounds drafting up to k:
    grown only when two more rounds might not fit (the block stops where its next
    round might not; a cache grown for the whole horizon would be read whole by every
    step on a CPU), the reads promising the horizon."""
    if end + 2 * (k + 1) > cache["pos"].shape[1]:
        cache = model_cache.grow(cache, catchup.bucket(end + horizon))
    return (cache, *dstep.block_reads(cfg, end, cache["pos"].shape[1], n_read, horizon))


def _regroup(caches_G, logits_G, ends: list[int], old: tuple, new: tuple, B: int):
    """Caches and logits from one grouping of the members into another (per group its
    member indices; a group's rows are member-major, B each): a member's rows sliced
    out of its group (a copy of the scalar 'end' each: caches are donated), a group's
    members' rows joined (caches grown to the largest, the write pointer the largest:
    every slot past a cache's own pointer is empty). Returns (caches, logits, fills),
    per group of ``new``."""
    caches, logits, fill = {}, {}, {}
    for g, idx in enumerate(old):
        for j, i in enumerate(idx):
            if len(idx) == 1:
                caches[i], logits[i] = caches_G[g], logits_G[g]
            else:
                caches[i] = jax.tree_util.tree_map(
                    lambda a, j=j: jnp.array(a) if a.ndim == 0 else a[j * B:(j + 1) * B],
                    caches_G[g])
                logits[i] = logits_G[g][j * B:(j + 1) * B]
            fill[i] = ends[g]
    out_c, out_l, out_e = [], [], []
    for idx in new:
        S = max(caches[i]["pos"].shape[1] for i in idx)
        parts = [model_cache.grow(caches[i], S) for i in idx]
        end = max(fill[i] for i in idx)
        cache = parts[0] if len(parts) == 1 else jax.tree_util.tree_map(
            lambda *a: a[0] if a[0].ndim == 0 else jnp.concatenate(a), *parts)
        out_c.append(dict(cache, end=jnp.asarray(end, jnp.int32)))
        out_l.append(jnp.concatenate([logits[i] for i in idx]))
        out_e.append(end)
    return out_c, out_l, out_e


# ----------------------------------------------------------------------------- results

@dataclasses.dataclass
class SpecGeneration(Generation):
    """:class:`brf.ensemble.decode.Generation` plus the acceptance statistics.

    ``trace`` rows (``trace=True``): per emitted token 'logq' (the fused
    distribution before the sampler), 'event', 'round', 'drafted' (whether it was
    an accepted draft token). ``engine``: where the rounds ran ('host', 'device').
    """
    spec: SpecStats = dataclasses.field(default_factory=SpecStats)
    engine: str = ""


# ----------------------------------------------------------------------------- the loop

def check_mode(mode: str) -> None:
    """Speculation verifies drafts against the fused distribution: mode 'fuse' only."""
    if mode != "fuse":
        raise EnsembleInputError(f"speculative decoding verifies drafts against the fused "
                                 f"distribution (mode 'fuse'); mode {mode!r} already runs one "
                                 "member per step: set config.speculative='' or mode='fuse'")


def check_speculative(members: Sequence[Member], spec: DraftSpec, mode: str = "fuse") -> None:
    """Refuses a drafter the token level cannot run (before any model runs)."""
    check_mode(mode)
    try:
        IdentitySpace(members, 1)
    except EnsembleInputError as e:
        raise EnsembleInputError(f"speculative decoding on tokens reads one draft with every "
                                 f"member, so the members must share one vocabulary: {e}. "
                                 "Speculate on bytes (level='bytes') across tokenizers") from None
    if spec.kind == "member":
        drafter_index(spec, [0] * len(members), [m.name for m in members])


def generate_speculative(members: Sequence[Member], prompts: Sequence[str], *,
                         drafter: str | DraftSpec, weights: Sequence[float] | None = None,
                         method: str = "linear", method_params: Mapping[str, Any] | None = None,
                         sampler: Sampler | str | None = None, max_new_tokens: int = 64,
                         stop: Sequence[str] = (), seed: int = 0, dtype=jnp.float32,
                         group: bool = True, trace: bool = False,
                         on_piece: Callable[[Piece], None] | None = None,
                         engine: str = "auto") -> list[SpecGeneration]:
    """Speculative fused decoding of a batch of prompts (module docstring).

    Args:
        members: the ensemble; one vocabulary.
        prompts: B prompt strings.
        drafter: a drafter spec (`brf.drafting.parse_drafter`).
        weights, method, method_params, sampler, max_new_tokens, stop, seed, dtype:
            as for :func:`brf.ensemble.decode.stream` in mode 'fuse'.
        group: members that share weights read as one batch (one call per model).
        trace: record every emitted token's fused distribution.
        on_piece: called with every piece of text as it becomes final.
        engine: 'device' (every round compiled and looped on the device,
            :func:`brf.ensemble.step.run_rounds`: no trace, every member on the
            same devices: one device, or one mesh whose 'data' axis may split
            the batch), 'host' (rounds on the host, paused steps as compiled
            blocks where the members are on the same devices),
            or 'auto' (the device where it applies and the members are on an
            accelerator; the host on a CPU). Either gives the same text for a seed.

    Returns:
        One :class:`SpecGeneration` per prompt.
    """
    members, prompts = list(members), list(prompts)
    spec = parse_drafter(drafter)
    if spec is None:
        raise EnsembleInputError("no speculative drafter given")
    sampler = Sampler.parse(sampler) if not isinstance(sampler, Sampler) else sampler
    method_params = dict(method_params or {})
    _check_request("fuse", "per_sequence", prompts, max_new_tokens, method, method_params,
                   sampler)
    w = normalised_weights(members, weights)
    method_params = _with_unembeddings(method, method_params, members)
    _check_method(method, method_params, len(members))
    check_speculative(members, spec)
    spec = spec.within(max_new_tokens)  # no round uses more (DraftSpec.within)
    if engine not in ENGINES:
        raise EnsembleInputError(f"unknown engine {engine!r}; use one of {ENGINES}")
    B = len(prompts)
    space = IdentitySpace(members, B)
    prompt_ids = [[m.prompt_ids(p) for p in prompts] for m in members]
    for m, ids in zip(members, prompt_ids):
        for p in ids:
            check_prompt_fits(m, p, max_new_tokens)
    space.start(prompt_ids)
    d_index = None
    if spec.kind == "member":
        d_index = drafter_index(spec, [param_count(m.params) for m in members],
                                [m.name for m in members])
    loop = _Loop(members, prompts, spec, w, method, method_params, sampler, max_new_tokens,
                 tuple(stop), seed, dtype, group, trace, space, prompt_ids, d_index)
    device = loop.blocks
    if engine == "device" and not device:
        raise EnsembleInputError("engine='device' runs speculative decoding without trace, "
                                 "with every member on the same devices; use engine='host' "
                                 "or 'auto'")
    # 'auto': compiled rounds on an accelerator, where each host round's read-backs cost
    # most of a small model's step; on a CPU the host rounds measured as fast and compile
    # in less time (BENCHMARKS.md, "Speculative rounds on the device")
    loop.on_device = device and (engine == "device" or (
        engine == "auto" and _platform(members) != "cpu"))
    return loop.run(on_piece)


def _platform(members) -> str:
    """The platform ('cpu', 'gpu', 'tpu') the first member's weights live on."""
    leaf = jax.tree_util.tree_leaves(members[0].params)[0]
    return next(iter(leaf.devices())).platform


def speculative_generate(members: Sequence[Member], prompts: Sequence[str], *,
                         drafter: str | DraftSpec, mode: str = "fuse",
                         aligner: str = "identity", aligner_params=None,
                         choice: str = "per_sequence", **kwargs) -> list[SpecGeneration]:
    """:func:`generate_speculative` called with :func:`brf.ensemble.decode.generate`'s
    keyword arguments (what `brf.ensemble.run` passes); the aligner must be 'identity'."""
    check_mode(mode)
    if aligner != "identity":
        raise EnsembleInputError(f"speculative decoding on tokens reads the drafts as the "
                                 f"members' shared token ids (aligner 'identity'); got aligner "
                                 f"{aligner!r}. Speculate on bytes (level='bytes') across "
                                 "tokenizers")
    del aligner_params, choice
    return generate_speculative(members, prompts, drafter=drafter, **kwargs)


def _control_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's control tokens (added tokens marked special: chat markers,
    BOS, EOS)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(int(i) for i, t in added.items() if getattr(t, "special", False))


def _before_control(draft: list[int], control: frozenset[int]) -> list[int]:
    """An n-gram draft cut before its first control token. With a chat template the
    prompt's last token ('\n' after 'assistant') occurs earlier in the template,
    before '<|im_start|>': copying that would draft the template's own markup, which
    the members never accept (issue 54: every first round wasted so)."""
    for j, e in enumerate(draft):
        if e in control:
            return draft[:j]
    return draft


def _verify(fused, drafts: list[list[int]], live: list[int], sampler: Sampler, k: int, key,
            dlogp) -> dict:
    """Per live row, the verdict on its draft against the fused distribution ``fused``
    ([B, K + 1, V]): greedy, the drafts that equal its argmax and the argmax after
    them; sampled, the device rounds' accept / resample step (with their shapes, the
    drafts padded to the drafter's k, and the round's key), so both engines draw the
    same random numbers. ``dlogp``: the log-probs a sampled member drafter drew its
    drafts from (None for a deterministic draft)."""
    if sampler.greedy:
        top = np.asarray(jnp.argmax(fused, axis=-1))
        return {b: verify_greedy(top[b], drafts[b]) for b in live}
    B = len(drafts)
    d_BxK = np.zeros((B, k), np.int32)
    for b in live:
        d_BxK[b, :len(drafts[b])] = drafts[b]
    acc_B, event_B = (np.asarray(x) for x in _accept_sampled(
        key, jnp.pad(fused, ((0, 0), (0, k + 1 - fused.shape[1]), (0, 0))),
        jnp.asarray(d_BxK), jnp.asarray([len(d) for d in drafts], jnp.int32),
        sampler=sampler, logp_BxKxV=dlogp))
    return {b: Verdict(int(acc_B[b]), int(event_B[b])) for b in live}


class _Loop:
    """One call of :func:`generate_speculative` (host bookkeeping, device states)."""

    def __init__(self, members, prompts, spec, w, method, method_params, sampler,
                 max_new_tokens, stop, seed, dtype, group, trace, space, prompt_ids, d_index):
        self.members, self.spec, self.method = members, spec, method
        self.method_params, self.sampler, self.max_new = method_params, sampler, max_new_tokens
        self.dtype, self.trace, self.space, self.d_index = dtype, trace, space, d_index
        self.B, self.n = len(prompts), len(members)
        self.w_dev = jnp.asarray(w, jnp.float32)
        self.key = jax.random.PRNGKey(seed)
        self.gens = [SpecGeneration(prompt=p, members_run=[0] * self.n,
                                    spec=SpecStats(drafter=spec.text)) for p in prompts]
        self.streams = [TextStream(stop) for _ in prompts]
        self.done = [False] * self.B
        self.history = [list(prompt_ids[0][b]) for b in range(self.B)]  # n-gram context
        self.control = _control_ids(members[0].tokenizer)
        # as plain decoding's (a cache twice as large costs every step's attention twice
        # as much on a CPU); a round's reads grow it when they need more
        slots = (catchup.bucket(max(len(p) for ids in prompt_ids for p in ids), 8)
                 + 2 * max_new_tokens)
        # groups of members that share weights: one state, rows member-major
        keys: dict = {}
        for i, m in enumerate(members):
            key = (id(m.params), m.cfg) if group else i
            keys.setdefault(key, []).append(i)
        self.groups = tuple(tuple(idx) for idx in keys.values())  # (the rounds' form)
        self.states = []
        for idx in self.groups:
            rows = [ids for i in idx for ids in prompt_ids[i]]
            self.states.append(catchup.start(members[idx[0]], rows, dtype=dtype, slots=slots))
        self.pending: list[tuple[int, ...]] = [()] * self.B
        share = 0.0
        if d_index is not None:
            sizes = [param_count(m.params) for m in members]
            # its step's share of a fused step: one forward pass per model (members that
            # share weights are read as one batch, which costs about one pass here)
            share = sizes[d_index] / sum(sizes[g[0]] for g in self.groups)
        self.sched = KSchedule(spec, unit="tokens", drafter_share=share)
        # the member drafter's state, started when it first drafts (_ensure_drafter)
        self.dstate = None
        self._slots, self._prompt_ids = slots, prompt_ids
        self.round = 0
        # rounds and paused steps taken: round t (plain step t) draws with the key
        # fold_in(PRNGKey(seed), t), as the device's rounds and plain decoding do
        self.key_step = 0
        self.seed = seed
        # members apart (each on its own devices): the rows to fuse go to member 0's, and
        # softmax-bottleneck fusion reads every member's output head there
        self.gather = _gatherer(members)
        if method_params.get("unembeddings") is not None:
            self.method_params = dict(method_params, unembeddings=[
                self.gather(u) for u in method_params["unembeddings"]])
        self.blocks = self._device_ready()
        self._plan = None
        self._rounds = None  # the device's round state, its members' form and fills
        self.on_device = False  # every round on the device (_run_on_device)

    # -- drafting
    def _ngram(self, b: int, k: int) -> list[int]:
        """The n-gram drafter's draft of up to k tokens for row b, cut before a control
        token."""
        return _before_control(ngram_draft(self.history[b], self.spec.n, self.spec.min_n,
                                           k), self.control)

    def _draft(self, caps: list[int], key) -> tuple[list[list[int]], Any]:
        """Per row, its draft (at most caps[b] tokens); and for a sampled member drafter
        the log-probs its drafts were drawn from, [B, spec k, V] (else None). The
        member drafter's draw j uses ``fold_in(key, j)``, as the device's rounds."""
        k = self.sched.k
        live = [b for b in range(self.B) if not self.done[b] and caps[b] > 0]
        drafts: list[list[int]] = [[] for _ in range(self.B)]
        if not live:
            return drafts, None
        if self.spec.kind == "ngram":
            for b in live:
                drafts[b] = self._ngram(b, min(k, caps[b]))
            return drafts, None
        steps = min(k, max(caps[b] for b in live))
        m = self.members[self.d_index]
        lps = []
        st = self.dstate
        for s in range(steps):
            st = catchup.catch_up(m, st, dtype=self.dtype)
            top, lp = _draft_draw(st.logits_BxV, jax.random.fold_in(key, s),
                                  sampler=self.sampler)
            top = np.asarray(top)
            lps.append(lp)
            new = [[int(top[b])] if b in live else [] for b in range(self.B)]
            for b in live:
                drafts[b].append(new[b][0])
            st = catchup.add_pending(st, new)
        self.dstate = st
        for b in live:
            drafts[b] = drafts[b][:caps[b]]
        if self.sampler.greedy:
            return drafts, None
        V = lps[0].shape[-1]
        pad = jnp.full((self.B, self.spec.k - len(lps), V), -jnp.inf, lps[0].dtype)
        return drafts, self.gather(jnp.concatenate([jnp.stack(lps, axis=1), pad], axis=1))

    # -- one round
    def _round(self) -> list[tuple[int, list[int], int]]:
        """One round on the host: the drafter's drafts read by every member in one call
        (:meth:`_member_logits`), fused, verified (:func:`_verify`), recorded
        (:meth:`_record_round`) and every state rolled back to the accepted text
        (:meth:`_roll_back_to_accepted`). Returns per live row (b, emitted, accepted):
        the events it emitted (its accepted drafts and the one after) and how many
        drafts it accepted.
        """
        B = self.B
        caps = [max(0, self.max_new - g.n_events - 1) for g in self.gens]
        k_round = self.sched.k
        key = jax.random.fold_in(self.key, self.key_step)
        self.key_step += 1
        drafts, dlogp = self._draft(caps, jax.random.fold_in(key, 1))
        live = [b for b in range(B) if not self.done[b]]
        # paused (k = 0): the n-gram drafter's would-be first token, checked for free
        # against the emitted one (brf.drafting.KSchedule)
        shadow = ({b: self._ngram(b, 1) for b in live}
                  if k_round == 0 and self.sched.free_checks else {})
        tokens = [list(self.pending[b]) + drafts[b] if b in live else [] for b in range(B)]
        per_member = self._member_logits(tokens, live, max(len(drafts[b]) for b in live))
        logp = _log_softmax(jnp.stack(per_member, axis=2))       # [B, K + 1, n, V]
        fused = fuse(self.method, logp, self.w_dev, validate=False, **self.method_params)
        fused_np = np.asarray(fused, np.float64) if self.trace else None
        verdicts = _verify(fused, drafts, live, self.sampler, self.spec.k, key, dlogp)
        out = self._record_round(k_round, drafts, verdicts, shadow, fused_np)
        self._roll_back_to_accepted(out, tokens)
        self.round += 1
        return out

    def _member_logits(self, tokens: list[list[int]], live: list[int], K: int) -> list:
        """Every member's logits at the K + 1 positions of every row ([B, K + 1, V] per
        member, brought to where the fusion runs): each group of members reads its
        rows' tokens (the pending one, then the draft) in one call, which leaves the
        group's state past them, and each live row's count of member runs goes up."""
        B = self.B
        per_member: list[Any] = [None] * self.n
        for g, idx in enumerate(self.groups):
            st = self.states[g]
            rows_tokens = [tokens[b] for _ in idx for b in range(B)]
            old = st.logits_BxV
            logits, st = read_all(self.members[idx[0]], st, rows_tokens, dtype=self.dtype)
            pend = [len(self.pending[b]) for _ in idx for b in range(B)]
            ix = np.minimum(np.asarray(pend)[:, None] + np.arange(K + 1)[None],
                            max(len(t) for t in rows_tokens))
            if logits is None:
                rows = old[:, None]
            else:
                rows = _gather_rows(old, logits, jnp.asarray(ix, jnp.int32))
            self.states[g] = st
            for r, i in enumerate(idx):
                per_member[i] = self.gather(rows[r * B:(r + 1) * B])
            for i in idx:
                for b in live:
                    self.gens[b].members_run[i] += 1
        return per_member

    def _record_round(self, k_round: int, drafts: list[list[int]], verdicts: dict,
                      shadow: dict, fused_np) -> list[tuple[int, list[int], int]]:
        """A round's verdicts (per live row) as its emitted events, recorded: each row's
        statistics and trace rows, the free checks of the n-gram drafter's would-be
        tokens (``shadow``) and, once a round (all rows share its k), the schedule's
        update. Returns per live row (b, emitted, accepted), as :meth:`_round`."""
        out = []
        drafted = accepted = rejected = checked = hits = 0
        for b, v in verdicts.items():
            d = drafts[b]
            emitted = d[:v.accepted] + [v.event]
            self.gens[b].spec.add(k_round, len(d), v.accepted)
            drafted, accepted = drafted + len(d), accepted + v.accepted
            rejected += v.accepted < len(d) or (k_round > 0 and not d)
            if shadow.get(b):
                checked, hits = checked + 1, hits + (shadow[b][0] == v.event)
            if self.trace:
                for j, e in enumerate(emitted):
                    self.gens[b].trace.append(dict(logq=fused_np[b, j], event=int(e),
                                                   round=self.round, drafted=j < v.accepted))
            out.append((b, emitted, v.accepted))
        self.sched.observe(hits, checked - hits)
        self.sched.update(drafted, accepted, rejected)  # once a round: all rows share k
        return out

    def _roll_back_to_accepted(self, out: list[tuple[int, list[int], int]],
                               tokens: list[list[int]]) -> None:
        """Every state rolled back to the accepted text after a round that read
        ``tokens`` (per row: its pending token, then its draft): each row keeps its
        pending token and its accepted drafts (:func:`rollback`), the token it emitted
        becomes pending, and a member drafter keeps what it read of the accepted text
        (:meth:`_rollback_drafter`)."""
        B = self.B
        keep = [0] * B
        new_pending = [() for _ in range(B)]
        for b, emitted, acc in out:
            keep[b] = len(self.pending[b]) + acc
            new_pending[b] = (emitted[-1],)
        for g, idx in enumerate(self.groups):
            st = self.states[g]
            n_read = [st.n_read[r * B + b] - len(tokens[b]) + keep[b]
                      for r in range(len(idx)) for b in range(B)]
            self.states[g] = rollback(st, n_read, [new_pending[b] for _ in idx
                                                   for b in range(B)])
        if self.dstate is not None:
            self._rollback_drafter(out)
        self.pending = new_pending

    def _rollback_drafter(self, out) -> None:
        """The drafter keeps what it read of the accepted text; the rest is pending.

        Per row it has read, this round, a prefix of its pending tokens at the
        round's start followed by its drafts; the accepted text is those pending
        tokens followed by the emitted ones. It keeps their common prefix (as far
        as it read), and what it has not read of the accepted text is pending.
        """
        st = self.dstate
        n0, p0 = self._d_start
        n_read, pending = list(st.n_read), [tuple(p) for p in st.pending]
        for b, emitted, acc in out:
            read = st.n_read[b] - n0[b]
            text = list(p0[b]) + list(emitted)
            keep = min(read, len(p0[b]) + acc)
            n_read[b] = n0[b] + keep
            pending[b] = tuple(text[keep:])
        self.dstate = rollback(st, n_read, pending)

    # -- paused: plain steps on the device
    def _device_ready(self) -> bool:
        """Rounds and paused steps can run as compiled programs: no trace asked for (they
        keep no distributions), every member on the same devices (one program holds
        them: one device, or one mesh, whose 'data' axis may split the batch)."""
        return not self.trace and _colocated(self.members)

    def _device_plan(self):
        """The compiled rounds' static spec and device tables (as plain decoding's), and
        the control events a draft stops before (bool [V] on the device); built once."""
        if self._plan is None:
            from brf.ensemble.decode import _device_plan
            job = types.SimpleNamespace(
                space=self.space, members=self.members, method=self.method,
                method_params=self.method_params, weights=np.asarray(self.w_dev),
                sampler=self.sampler, max_new_tokens=self.max_new, dtype=self.dtype,
                mode="fuse", choice="per_sequence")
            control = np.zeros(self.space.size, bool)
            control[[c for c in self.control if 0 <= c < self.space.size]] = True
            self._plan = (*_device_plan(job)[:2], jnp.asarray(control))
        return self._plan

    def _run_on_device(self, on_piece) -> list[SpecGeneration]:
        """The whole generation as blocks of compiled rounds (``brf.ensemble.step.
        run_rounds``): no trace. A round drafts on the device, verifies and cuts the
        caches back there; a paused block is rounds that draft nothing (plain fused
        steps). Members that share weights are read as one batch (``group``), as in
        the host rounds. A member drafter's state joins each drafting block and
        leaves it after (:meth:`_drafter_to_device`). Between blocks the host replays
        the emitted events (text, stop strings, statistics). The schedule is followed
        on the device: it picks each round's k there, and a drafting block ends where
        it would pause; the host's schedule, given the rounds one by one, picks the
        next block's first k."""
        self._to_rounds()
        while not all(self.done):
            self._device_block(on_piece)
        return self.gens

    def _to_rounds(self) -> None:
        """The rounds' group states (rows member-major) as the device's round state,
        from wherever the generation is: the key's step, each row's finished flag,
        events, pending token (``self.pending``) and n-gram context. Their caches
        move to the round state, which donates them."""
        B = self.B
        groups = self.groups
        states, self.states = self.states, [None] * len(groups)
        H = catchup.bucket(max(len(h) for h in self.history) + self.max_new + self.spec.k + 2)
        history = np.zeros((B, H), np.int32)
        for b, h in enumerate(self.history):
            history[b, :len(h)] = h
        st = dstep.RoundState(
            dstep.DecodeState(tuple(s.cache for s in states),
                              tuple(s.logits_BxV for s in states), jnp.int32(self.key_step),
                              jnp.asarray(np.asarray(self.done, bool)),
                              jnp.asarray(np.asarray([g.n_events for g in self.gens],
                                                     np.int32)),
                              jax.random.PRNGKey(self.seed)),  # (donated: a fresh copy)
            jnp.asarray(np.asarray([p[0] if p else 0 for p in self.pending], np.int32)),
            jnp.asarray(np.asarray([len(p) > 0 for p in self.pending], bool)),
            jnp.asarray(history), jnp.asarray([len(h) for h in self.history], jnp.int32))
        self._rounds = dict(st=st, form=groups, ends=[s.end for s in states])

    def _from_rounds(self) -> None:
        """The device's round state back into the rounds' group states (after
        :meth:`_to_rounds`): each row's last emitted token pending."""
        r, self._rounds = self._rounds, None
        if r is None:
            return
        B = self.B
        st, groups = r["st"], self.groups
        caches, logits, ends = _regroup(st.dec.caches, st.dec.logits, r["ends"], r["form"],
                                        groups, B)
        last, has_last = np.asarray(st.last), np.asarray(st.has_last)
        self.pending = [(int(last[b]),) if has_last[b] and not self.done[b] else ()
                        for b in range(B)]
        for g, idx in enumerate(groups):
            n_read = tuple(len(self._prompt_ids[i][b]) + self.gens[b].n_events
                           - len(self.pending[b]) for i in idx for b in range(B))
            self.states[g] = catchup.MemberState(
                caches[g], logits[g], tuple(self.pending[b] for _ in idx for b in range(B)),
                ends[g], n_read)

    def _device_block(self, on_piece) -> None:
        """One block of compiled rounds drafting the schedule's k (a paused block when it
        is 0: the program plain decoding runs), replayed on the host."""
        B, members = self.B, self.members
        spec, tables, control = self._device_plan()
        st, form, ends = self._rounds["st"], self._rounds["form"], self._rounds["ends"]
        groups = self.groups
        live = [b for b in range(B) if not self.done[b]]
        k_first = self.sched.k
        k = self.spec.k if k_first else 0  # the rounds' shapes: one program for every k
        rounds = PAUSED_BLOCK if k == 0 else ROUND_BLOCK
        # drafting rounds read members that share weights as one batch; plain steps
        # one cache per member (on this CPU, paused generations of the prompt
        # ensemble ran slower with the group's rows in one batch)
        want = groups if k else tuple((i,) for i in range(self.n))
        if want != form:
            caches, logits, ends = _regroup(st.dec.caches, st.dec.logits, ends, form, want, B)
            st = st._replace(dec=st.dec._replace(caches=tuple(caches), logits=tuple(logits)))
            form = want
        prompt_len = [[len(p) for i in idx for p in self._prompt_ids[i]] for idx in form]
        params = tuple(members[idx[0]].params for idx in form)
        horizon = rounds * (k + 1) + k + 1
        caches, reads, spans = [], [], []
        for g, idx in enumerate(form):
            # tokens read so far: the prompt and every emitted event but the pending last
            n_read = [prompt_len[g][j * B + b] + max(self.gens[b].n_events - 1, 0)
                      for j in range(len(idx)) for b in live]
            c, rd, span = _round_room(members[idx[0]].cfg, st.dec.caches[g], ends[g],
                                      n_read, k, horizon)
            caches.append(c)
            reads.append(rd)
            spans.append(span)
        st = st._replace(dec=st.dec._replace(caches=tuple(caches)))
        sched, rule = None, None
        if k:  # the schedule picks each round's k on the device
            s = self.sched
            sched = dstep.Schedule(jnp.float32(s.hits), jnp.float32(s.misses),
                                   jnp.int32(s.size))
            rule = (DECAY, s.overhead, s.cost, s.never_pause, s.adaptive, s.k_max)
        draft = self.d_index if k else None
        dreads = dspan = dparams = None
        if draft is not None:
            st, dreads, dspan = self._drafter_to_device(st, k, live, horizon)
            dparams = members[draft].params
        st, em, cnt, dra, acc, ks, r, fill = dstep.run_rounds(
            spec, params, tables, st, control, sched, k_first, dparams,
            rounds=rounds, k=k, n=self.spec.n, min_n=self.spec.min_n, rule=rule,
            reads=tuple(reads), spans=tuple(spans), groups=form, draft=draft, dreads=dreads,
            dspan=dspan)
        if draft is not None:
            st = self._drafter_from_device(st)
        em, cnt, dra, acc, ks, r = (np.asarray(em), np.asarray(cnt), np.asarray(dra),
                                    np.asarray(acc), np.asarray(ks), int(r))
        ends = [int(x) for x in np.asarray(fill)]
        if r == 0:
            raise RuntimeError("a block of speculative rounds made no progress")
        self.key_step += r
        if k == 0:
            self._replay_plain(em[:r, :, 0], r, live, on_piece)
        else:
            for t in range(r):
                rows = [(b, em[t, b, :cnt[t, b]].tolist(), int(dra[t, b]), int(acc[t, b]))
                        for b in live if cnt[t, b] > 0 and not self.done[b]]
                self._replay_round(int(ks[t]), rows, on_piece)
        stopped = [b for b in live if self.done[b]]
        if stopped:
            st = st._replace(dec=st.dec._replace(
                finished=st.dec.finished.at[jnp.asarray(stopped)].set(True)))
        self._rounds = dict(st=st, form=form, ends=ends)

    def _drafter_to_device(self, st, k: int, live: list[int], horizon: int):
        """The member drafter's state into a drafting block's round state: started if it
        has not drafted yet, every pending token read (on the host), its cache grown
        as the members' are (:func:`_round_room`). Returns (state, its reads, its
        span)."""
        self._ensure_drafter()
        m = self.members[self.d_index]
        ds = catchup.catch_up(m, self.dstate, dtype=self.dtype)
        self.dstate = None  # its cache now lives in the round state, which donates it
        c, rd, span = _round_room(m.cfg, ds.cache, ds.end, [ds.n_read[b] for b in live], k,
                                  horizon)
        B = self.B
        drafter = dstep.DrafterState(c, ds.logits_BxV, jnp.zeros((B, 2), jnp.int32),
                                     jnp.zeros((B,), jnp.int32))
        return st._replace(drafter=drafter), rd, span

    def _drafter_from_device(self, st):
        """The member drafter's state back from a block's round state (its pending
        tokens, its fill and positions read back)."""
        ds = st.drafter
        pend, n_pend = np.asarray(ds.pending), np.asarray(ds.n_pending)
        self.dstate = catchup.MemberState(
            ds.cache, ds.logits, tuple(tuple(int(t) for t in pend[b, :n_pend[b]])
                                       for b in range(self.B)),
            int(ds.cache["end"]), tuple(int(x) for x in np.asarray(ds.cache["next_pos"])))
        return st._replace(drafter=None)

    def _replay_round(self, k: int, rows, on_piece) -> None:
        """The host's side of one drafting round run on the device: per row (b, the
        events emitted, drafted, accepted) the statistics, the text and the finish
        rules, then the schedule's update (as :meth:`run` does after :meth:`_round`)."""
        drafted = accepted = rejected = 0
        for b, emitted, d, a in rows:
            self.gens[b].spec.add(k, d, a)
            for i in range(self.n):
                self.gens[b].members_run[i] += 1
            drafted, accepted = drafted + d, accepted + a
            rejected += a < d or not d
            self._emit(b, emitted, a + 1, on_piece)
        self.sched.update(drafted, accepted, rejected)
        self.round += 1

    def _replay_plain(self, events_KxB, k: int, live: list[int], on_piece) -> None:
        """The host's side of k plain steps run on the device: each emitted event
        replayed as a round's (text, stop strings, the finish rules), the n-gram
        drafter's would-be draft before it checked against the events from it on
        (``KSchedule.observe``), the schedule updated once for the block, and a member
        drafter given the events to read when it next drafts."""
        B, n = self.B, self.n
        emitted = [[] for _ in range(B)]
        would = []  # (row, where in its emitted tokens, the n-gram drafter's draft there)
        for t in range(k):
            for b in live:
                e = int(events_KxB[t, b])
                if e < 0 or self.done[b]:
                    continue
                if self.sched.free_checks:
                    d = self._ngram(b, self.sched.size)
                    if d:
                        would.append((b, len(emitted[b]), d))
                self.gens[b].spec.add(0, 0, 0)
                for i in range(n):
                    self.gens[b].members_run[i] += 1
                emitted[b].append(e)
                piece, reason = self._advance(b, e)
                if (piece or reason) and on_piece is not None:
                    on_piece(Piece(b, piece, reason))
                if reason is not None:
                    self.done[b] = True
        # each would-be draft against the tokens emitted after it, as far as the block
        # went: its agreeing prefix accepted, a disagreement a rejection
        ok = rejected = 0
        for b, at, d in would:
            after = emitted[b][at:]
            m = next((j for j, (x, y) in enumerate(zip(d, after)) if x != y),
                     min(len(d), len(after)))
            ok += m
            rejected += m < min(len(d), len(after))
        self.sched.observe(ok, rejected)
        self.sched.update(0, 0, steps=k)
        if self.dstate is not None:  # the member drafter reads them when it drafts
            self.dstate = catchup.add_pending(self.dstate, emitted)

    def _ensure_drafter(self) -> None:
        """Starts the member drafter's state on its prompts, with what has been emitted
        so far pending (a drafter that never drafts costs nothing)."""
        if self.dstate is not None:
            return
        st = catchup.start(self.members[self.d_index], self._prompt_ids[self.d_index],
                           dtype=self.dtype, slots=self._slots)
        self.dstate = catchup.add_pending(st, [
            self.history[b][len(self._prompt_ids[0][b]):] for b in range(self.B)])

    def run(self, on_piece) -> list[SpecGeneration]:
        for g in self.gens:
            g.engine = "device" if self.on_device else "host"
        if self.on_device:
            return self._run_on_device(on_piece)
        while not all(self.done):
            if self.sched.k == 0 and self.blocks:  # paused: plain decoding's compiled steps
                if self._rounds is None:
                    self._to_rounds()
                self._device_block(on_piece)
                continue
            self._from_rounds()
            if self.d_index is not None and self.sched.k > 0:
                self._ensure_drafter()
            if self.dstate is not None:
                self._d_start = (self.dstate.n_read, self.dstate.pending)
            for b, emitted, _ in self._round():
                self._emit(b, emitted, len(emitted), on_piece)
        return self.gens

    def _emit(self, b: int, emitted, verified: int, on_piece) -> None:
        """Row b's events of a round, in order, up to the one that finishes it (text,
        pieces streamed); the round's statistics counted ``verified`` events (the
        accepted drafts and the one after), so those past the end are taken back."""
        for j, e in enumerate(emitted):
            piece, reason = self._advance(b, e)
            if (piece or reason) and on_piece is not None:
                on_piece(Piece(b, piece, reason))
            if reason is not None:
                self.done[b] = True
                self.gens[b].spec.discard(verified - j - 1)  # past the end
                return

    def _advance(self, b: int, e: int) -> tuple[str, str | None]:
        """One emitted token of row b: text, stop conditions (as decode._advance)."""
        space, g, text = self.space, self.gens[b], self.streams[b]
        g.n_events += 1
        reason, piece = None, ""
        if space.is_eos(e):
            reason = "eos"
        else:
            space.advance(b, e, [0] * self.n)
            self.history[b].append(int(e))
            piece = text.update(space.text(b))
            if text.stopped:
                reason = "stop"
            elif g.n_events >= self.max_new:
                reason = "length"
        if reason is not None:
            piece += text.update(space.text(b), final=True)
            g.finish_reason = reason
            g.data = space.raw(b)
            g.member_ids = [tuple(space.member_ids(i, b)) for i in range(self.n)]
        g.text = text.text
        return piece, reason


__all__ = ["SpecGeneration", "check_mode", "check_speculative", "generate_speculative",
           "read_all", "rollback", "speculative_generate"]
