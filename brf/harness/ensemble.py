"""A brf ensemble as the evaluation harness asks for it: continuations scored, documents
scored, text generated. No lm_eval import here (brf/harness/__init__.py adapts it).

Two levels, one code path each whatever the number of members (one member is an
ensemble of one):

* **tokens** (members share one vocabulary): each member reads its context tokens and
  the continuation's tokens in one batched forward pass; the members' logits at the
  continuation's positions are fused by the method (``brf.fuse``), and the
  continuation's log-probability is the sum of the fused log-probs of its tokens.
  Requests are sorted by length, longest first, and run ``batch_size`` at a time, as
  the harness's own backends do; rows are padded to a multiple of ``PAD`` tokens so
  that few shapes compile.
* **bytes** (members with different tokenizers): each member reads its context's
  tokens, then the continuation byte by byte with every tokenization its beam keeps
  (`brf.bytes.lm.score_text`); the members' next-byte distributions (257 events) are
  fused per byte as byte-level generation fuses them, and the continuation's
  log-probability is the sum over its bytes. ``lost`` (per member, nats) is the log-mass
  pruning dropped: a reported log-probability lies at most that far below the exact
  one (0 in the exact mode). One request at a time (each has its own cover).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.align.vocab import encode_text
from brf.ensemble.member import Member, check_shared_vocabulary, normalised_weights
from brf.errors import UserError
from brf.runtime import trim_heap

PAD = 32  # token rows are padded to a multiple of this (one compiled shape per bucket)


class HarnessInputError(UserError):
    """A request or setting the harness model cannot honour (named in the message)."""


@dataclasses.dataclass
class ByteReport:
    """What one byte-level answer rests on: per member, the pruned log-mass (nats)."""
    lost: list[float]
    n_bytes: int


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation tokens as the harness's causal backends make them:
    the context's trailing whitespace moves to the continuation, the whole text is
    encoded and split after the context's own tokens; an empty context becomes the
    prefix token (BOS, else EOS)."""
    if not context:
        cont = encode_text(tok, continuation)
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    context, continuation = split_spaces(context, continuation)
    whole = encode_text(tok, context + continuation, add_special_tokens=True)
    ctx = encode_text(tok, context, add_special_tokens=True)
    return ctx, whole[len(ctx):]


def split_spaces(context: str, continuation: str) -> tuple[str, str]:
    """The context's trailing whitespace moved to the continuation (as `encode_pair`)."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


@jax.jit
def _gather_rows(logits_BxTxV, pos_BxC):
    """Rows ``pos`` of each sequence's logits: [B, C, V]."""
    return jnp.take_along_axis(logits_BxTxV, pos_BxC[:, :, None], axis=1)


class Ensemble:
    """Members, a fusion method and its parameters; scoring and generation on either level.

    Args:
        members: the members (`brf.ensemble.member.Member`), weights as given on them.
        method, method_params: a registered fusion method and its parameters.
        level: 'tokens' or 'bytes'.
        beam, threshold: the byte level's pruning (`brf.bytes.Settings`).
        batch_size: token-level requests per forward pass.
        max_length: the most tokens a member reads at once (contexts are cut on the left).
        dtype: the members' compute dtype.
        drafter: speculative fused decoding's drafter (`brf.drafting.DraftSpec`) for
            generation, or None: greedy output is the same text either way.
        weights: the member weights (on the simplex), or None: the members' own.
        byte_cache: a dict shared by ensembles of the same loaded members (several
            methods on one task): each model's byte-level view is built once and each
            member's byte-level scores of a request computed once, read back by the
            others (the fusion is what differs).
        trim: return the C heap's freed memory to the system after each byte-level
            request and rolling window (`brf.runtime.trim_heap`; False only to measure
            what it saves, `brf.harness.bench.byte_memory`).
    """

    def __init__(self, members: Sequence[Member], method: str, method_params: Mapping[str, Any],
                 *, level: str, beam: int, threshold: float, batch_size: int, max_length: int,
                 dtype=jnp.float32, drafter=None, weights: Sequence[float] | None = None,
                 byte_cache: dict | None = None, trim: bool = True):
        self.members = list(members)
        self.trim = trim
        self.weights = normalised_weights(self.members, weights)
        self.byte_cache = byte_cache
        self.method, self.method_params = method, dict(method_params)
        self.level, self.beam, self.threshold = level, beam, threshold
        self.batch_size, self.max_length, self.dtype = batch_size, max_length, jnp.dtype(dtype)
        if level == "tokens":
            check_shared_vocabulary(self.members)
        self.drafter = drafter
        if drafter is not None and level == "tokens":
            from brf.ensemble.speculative import check_speculative
            check_speculative(self.members, drafter)
        self._views = None

    # -- the token level -------------------------------------------------------------

    def token_requests(self, pairs: Sequence[tuple[str, str]]):
        """Each (context, continuation) as (per-member context ids, continuation ids)."""
        tok = self.members[0].tokenizer
        out = []
        for context, continuation in pairs:
            ctx, cont = encode_pair(tok, context, continuation)
            if not cont:
                raise HarnessInputError(f"an empty continuation after {context[-40:]!r}")
            plain_ctx = split_spaces(context, continuation)[0]
            per = [ctx if not (m.prefix or m.chat or m.template is not None)
                   else m.prompt_ids(plain_ctx) for m in self.members]
            out.append((per, cont))
        return out

    def score_tokens(self, requests, bar=None) -> list[tuple[float, bool]]:
        """(log-prob, greedy) of each request ((per-member context ids, continuation ids)),
        batched, longest first; answers in the requests' order."""
        order = token_order(requests)
        out: list[Any] = [None] * len(requests)
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            for i, ans in zip(idx, self._token_batch([requests[i] for i in idx])):
                out[i] = ans
            if bar is not None:
                bar.update(len(idx))
        return out

    def _token_batch(self, batch) -> list[tuple[float, bool]]:
        lp, top = self.run_token_arrays(*self.token_arrays(batch))
        return [(float(np.sum(lp[b, :len(cont)], dtype=np.float64)),
                 bool(np.all(top[b, :len(cont)] == cont))) for b, (_, cont) in enumerate(batch)]

    def token_arrays(self, batch) -> tuple[list, np.ndarray]:
        """A batch of requests as arrays: per member (tokens [B, W], valid [B, W], the
        rows predicting each continuation token [B, C]), W padded to a multiple of
        :data:`PAD`; and the continuation tokens [B, C] (0-padded)."""
        B, C = len(batch), max(len(cont) for _, cont in batch)
        per = []
        for j in range(len(self.members)):
            rows = [(ctx[j] + cont)[-(self.max_length + 1):][:-1] for ctx, cont in batch]
            W = -(-max(len(r) for r in rows) // PAD) * PAD
            toks = np.zeros((B, W), np.int32)
            valid = np.zeros((B, W), bool)
            pos = np.zeros((B, C), np.int32)
            for b, (r, (_, cont)) in enumerate(zip(rows, batch)):
                toks[b, :len(r)], valid[b, :len(r)] = r, True
                first = len(r) - len(cont)  # the row predicting the first continuation token
                pos[b, :len(cont)] = np.arange(first, len(r))
            per.append((toks, valid, pos))
        gold = np.zeros((B, C), np.int32)
        for b, (_, cont) in enumerate(batch):
            gold[b, :len(cont)] = cont
        return per, gold

    def run_token_arrays(self, per, gold) -> tuple[np.ndarray, np.ndarray]:
        """(fused log-prob of each continuation token [B, C], the fused argmax [B, C]) on
        the host, from :meth:`token_arrays`: each member's forward pass, the fusion."""
        from brf.models import forward
        logits = []
        for m, (toks, valid, pos) in zip(self.members, per):
            x, _ = forward(m.params, m.cfg, jnp.asarray(toks), jnp.asarray(valid),
                           dtype=self.dtype)
            logits.append(_gather_rows(x, jnp.asarray(pos)))
        V = min(int(x.shape[-1]) for x in logits)
        logq = self._fuse_tokens(jnp.stack([x[..., :V] for x in logits], axis=2))
        return jax.device_get(_gold_and_top(logq, jnp.asarray(gold)))

    def _fuse_tokens(self, logits_BxCxnxV):
        from brf.fusion import fuse
        return fuse(self.method, logits_BxCxnxV, jnp.asarray(self.weights, jnp.float32),
                    **self.method_params)

    # -- the byte level --------------------------------------------------------------

    def views(self):
        """Each member's byte-level view (`brf.bytes.lm.ByteLM`), built once."""
        if self._views is None:
            from brf.align.union import default_cache_dir
            from brf.bytes.lm import ByteLM
            made: dict = {} if self.byte_cache is None else self.byte_cache
            views = []
            for m in self.members:  # one view per model (and per byte_cache's models)
                key = ("view", id(m.params), self.dtype.name)
                hit = made.get(key)
                if hit is None or hit[1] is not m.params:
                    hit = made[key] = (ByteLM(m.params, m.cfg, m.tokenizer, name=m.name,
                                              dtype=self.dtype, cache_dir=default_cache_dir()),
                                       m.params)
                views.append(hit[0])
            self._views = views
        return self._views

    def byte_context(self, m: Member, lm, context: str) -> list[int]:
        """Member ``m``'s context tokens on the byte level (BOS, or EOS where the model
        has none, for an empty plain context)."""
        ids = m.prompt_ids(context) if context or m.prefix or m.chat or m.template else []
        if not ids:
            ids = list(lm.context()) if lm.cfg.bos_id is not None else sorted(m.eos_ids())[:1]
        return ids

    def score_bytes(self, pairs: Sequence[tuple[str, str]], bar=None
                    ) -> list[tuple[float, bool, ByteReport]]:
        """(log-prob, greedy, report) of each (context, continuation) on the byte level,
        longest continuation first; answers in the requests' order. Greedy: every byte
        is the fused distribution's most likely event."""
        lms = self.views()
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][1].encode("utf-8")))
        out: list[Any] = [None] * len(pairs)
        for i in order:
            context, continuation = split_spaces(*pairs[i])
            data = continuation.encode("utf-8")
            if not data:
                raise HarnessInputError(f"an empty continuation after {context[-40:]!r}")
            got = [self._member_bytes(m, lm, self.byte_context(m, lm, context), data)
                   for m, lm in zip(self.members, lms)]
            total, greedy = self._fused_bytes([g[0] for g in got], data)
            out[i] = (total, greedy, ByteReport([g[1] for g in got], len(data)))
            if bar is not None:
                bar.update(1)
            # each request allocates and frees its own buffers, which glibc keeps: RSS
            # grew by about 50 MB a request without this (BENCHMARKS.md, the harness)
            if self.trim:
                trim_heap()
        return out

    def _member_bytes(self, m: Member, lm, ids: Sequence[int], data: bytes):
        """(member ``m``'s next-byte log-probs [len(data), 257] after the tokens ``ids``,
        the log-mass pruning dropped), read back from ``byte_cache`` where it has them."""
        from brf.bytes.lm import score_text
        key = (id(m.params), tuple(ids), data, self.beam, self.threshold, self.dtype.name)
        hit = None if self.byte_cache is None else self.byte_cache.get(key)
        if hit is None or hit[2] is not m.params:  # (an id reused: not a hit)
            sc = score_text(lm, data, context_ids=ids, beam=self.beam, threshold=self.threshold)
            hit = (sc.logp, float(sc.stats["lost"]), m.params)
            if self.byte_cache is not None:
                self.byte_cache[key] = hit
        return hit[0], hit[1]

    def _fused_bytes(self, rows: Sequence[np.ndarray], data: bytes) -> tuple[float, bool]:
        """(the fused log-probability of ``data``, whether every byte is the fused argmax)
        from each member's rows."""
        from brf.bytes.generate import fused_bytes
        logp_Nxn = np.stack(rows, axis=1)
        total, greedy = 0.0, True
        for k, b in enumerate(data):
            logq = fused_bytes(self.method, self.method_params, logp_Nxn[k], self.weights)
            total += float(logq[b])
            greedy &= int(np.argmax(logq)) == b
        return total, bool(greedy)

    def rolling_bytes(self, doc: str) -> tuple[float, ByteReport]:
        """The fused log-probability of a whole document on the byte level, in windows
        that fit every member's context (:meth:`byte_windows`): each window's bytes are
        scored after the member's tokens of the text before it (the first after BOS)."""
        data = doc.encode("utf-8")
        if not data:  # nothing to predict (as the token level's windows)
            return 0.0, ByteReport([0.0] * len(self.members), 0)
        lms = self.views()
        total, lost = 0.0, [0.0] * len(self.members)
        for start, end, contexts in self.byte_windows(data):
            got = [self._member_bytes(m, lm, ids, data[start:end])
                   for m, lm, ids in zip(self.members, lms, contexts)]
            total += self._fused_bytes([g[0] for g in got], data[start:end])[0]
            lost = [a + g[1] for a, g in zip(lost, got)]
            if self.trim:
                trim_heap()
        return total, ByteReport(lost, len(data))

    def byte_windows(self, data: bytes) -> list[tuple[int, int, list[list[int]]]]:
        """Consecutive windows (start, end, each member's context tokens) covering
        ``data``: each window at most half the context (``max_length``) in every member's
        tokens, ended after a newline or space where one lies in its second half; its
        context the member's tokens of the text before it (after BOS, and the dummy
        prefix of a member that has one), cut on the left so that context and window fit
        ``max_length`` (the token level's rolling windows also drop BOS once cut)."""
        lms = self.views()
        half = max(1, self.max_length // 2)
        heads = [self.byte_context(m, lm, "") for m, lm in zip(self.members, lms)]
        leads = [lm.lead_after(h) for lm, h in zip(lms, heads)]
        fits = lambda s, e: all(len(lm.encode(data[s:e])) <= half for lm in lms)  # noqa: E731
        out, start = [], 0
        while start < len(data):
            lo, hi = start + 1, len(data)  # the longest window that fits (binary search)
            if not fits(start, lo):
                raise HarnessInputError(f"byte {start} of the document cannot be read within "
                                        f"max_length={self.max_length} tokens")
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(start, mid) else (lo, mid - 1)
            end = lo
            if end < len(data):
                cut = max(data.rfind(b"\n", start, end), data.rfind(b" ", start, end))
                if cut + 1 > start + (end - start) // 2:
                    end = cut + 1
            contexts = []
            for lm, head, lead in zip(lms, heads, leads):
                ids = head if start == 0 else head + lm.encode(lead + data[:start])
                room = self.max_length - len(lm.encode(data[start:end]))
                contexts.append(list(ids[-room:]))
            out.append((start, end, contexts))
            start = end
        return out

    # -- generation ------------------------------------------------------------------

    def generate(self, contexts: Sequence[str], *, until: Sequence[str], max_gen_toks: int,
                 max_gen_bytes: int, sampler, seed: int) -> list[str]:
        """Fused generation for each context (one gen_kwargs group), cut before the first
        stop string; tokens in batches of ``batch_size``, bytes one context at a time."""
        stop = [s for s in until if s]
        common = dict(weights=self.weights, method=self.method,
                      method_params=self.method_params, sampler=sampler, stop=stop, seed=seed)
        if self.level == "bytes":
            from brf.bytes.generate import generate_bytes
            from brf.bytes.speculative import generate_bytes_speculative
            lms = self.views()
            texts = []
            for c in contexts:
                extra = {} if self.drafter is None else dict(
                    drafter=self.drafter, lookup=c.encode("utf-8"))
                g = (generate_bytes if self.drafter is None else generate_bytes_speculative)(
                    lms, [self.byte_context(m, lm, c) for m, lm in zip(self.members, lms)],
                    **common, **extra, max_bytes=max_gen_bytes, beam=self.beam,
                    threshold=self.threshold,
                    eos_ids=[sorted(m.eos_ids()) for m in self.members])
                texts.append(g.text)
            return [cut(t, stop) for t in texts]
        from brf.ensemble import generate
        from brf.ensemble.speculative import generate_speculative
        texts = []
        for s in range(0, len(contexts), self.batch_size):
            batch = list(contexts[s:s + self.batch_size])
            if self.drafter is None:
                gens = generate(self.members, batch, **common, max_new_tokens=max_gen_toks,
                                aligner="identity", dtype=self.dtype)
            else:
                gens = generate_speculative(self.members, batch, drafter=self.drafter,
                                            **common, max_new_tokens=max_gen_toks,
                                            dtype=self.dtype)
            texts += [g.text for g in gens]
        return [cut(t, stop) for t in texts]


def token_order(requests) -> list[int]:
    """The order token-level requests run in: longest (context plus continuation) first."""
    return sorted(range(len(requests)), key=lambda i: -max(
        len(c) for c in requests[i][0]) - len(requests[i][1]))


@jax.jit
def _gold_and_top(logq_BxCxV, gold_BxC):
    return (jnp.take_along_axis(logq_BxCxV, gold_BxC[:, :, None], axis=-1)[..., 0],
            jnp.argmax(logq_BxCxV, axis=-1))


def cut(text: str, stop: Sequence[str]) -> str:
    """``text`` before the first occurrence of each stop string (the harness's rule)."""
    for s in stop:
        if s:
            text = text.split(s)[0]
    return text
