"""Cross-vocabulary event spaces for the decoder, over ``brf.align``.

Events are those of a ``brf.align`` aligner ('union': CONTROL plus every
distinct byte string of a member token; 'topk_union': the union of the
members' top-k events, re-scored by its backoff rule). The text is the
concatenation of the chosen events' bytes. After each event every member
re-encodes the text with ``brf.align.reencode`` with ``frozen`` = the tokens it
has already read into its KV cache: a member that has not read its recent
tokens yet (mixture sampling) gets them re-tokenized canonically together with
the new bytes (only pending tokens are ever retracted), and a member that read
everything appends. CONTROL ends the sequence (the members' EOS / end-of-turn
tokens all map to it).

Events a member cannot read back (bytes its vocabulary lacks, e.g. SmolLM2 has
no token for 0xC0 or 0xF5..0xFF while Gemma's byte fallback has all 256) are
excluded from sampling: ``mask_E`` is False for them and the decoder
renormalises over the rest. The distribution a step *reports* (trace) is the
aligned / fused one before that mask.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf import align
from brf.align.reencode import check_reencodable
from brf.align.vocab import encode_texts
from brf.ensemble.member import EnsembleInputError, Member


def _expressible(strings: Sequence[bytes], codecs) -> np.ndarray:
    """bool [U]: every member has a token for each byte of the string (CONTROL: True).

    Conservative: a byte a member has no single token for (and so cannot be
    produced by its byte-level fallback) makes the string unreadable for it.
    """
    ok_256 = np.ones(256, bool)
    for c in codecs:
        ok_256 &= c.byte_ids >= 0
    lengths = np.array([len(s) for s in strings])
    data = np.frombuffer(b"".join(strings), np.uint8)
    bad = ~ok_256[data]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = np.ones(len(strings), bool)
    nonempty = lengths > 0
    if bad.size:
        any_bad = np.logical_or.reduceat(bad, starts[nonempty]) if nonempty.any() else []
        out[nonempty] = ~np.asarray(any_bad, bool)
    return out


@functools.partial(jax.jit, static_argnames=("num_events",))
def _union_one(logits_BxV, index_V, num_events):
    return align.union_logprobs((logits_BxV,), (index_V,), num_events=num_events)[:, 0]


# (aligner, tokenizer ids, head sizes) -> built tables; the value keeps the
# tokenizers alive, so their ids cannot be reused while the entry exists.
_BUILT: dict[tuple, tuple] = {}


def _build(aligner: str, tokenizers: tuple, vocab_sizes: tuple[int, ...]):
    """Codecs, alignment, event mask and token maps for a member set, built once."""
    key = (aligner, tuple(id(t) for t in tokenizers), vocab_sizes)
    if key in _BUILT:
        return _BUILT[key][1]
    try:
        codecs = [align.make_codec(t) for t in tokenizers]
        alignment = align.make_aligner(aligner, [c.table for c in codecs])
        if aligner != "identity":  # chosen text is re-encoded into each member's tokens
            for j, c in enumerate(codecs):
                check_reencodable(c, f"member {j}'s tokenizer")
    except ValueError as e:
        raise EnsembleInputError(f"aligner {aligner!r}: {e}") from None
    for j, (c, v) in enumerate(zip(codecs, vocab_sizes)):
        if c.table.size > v:
            raise EnsembleInputError(f"member {j}: tokenizer has {c.table.size} tokens, the "
                                     f"model only {v} logits")
    union = alignment.union
    mask_E, index, token_mask = None, None, None
    if union is not None:
        mask_np = _expressible(union.strings, codecs)
        mask_E = jnp.asarray(mask_np)
        index = [np.asarray(ix) for ix in union.index]
        token_mask = [jnp.asarray(np.pad(mask_np[ix], (0, v - len(ix))))
                      for ix, v in zip(index, vocab_sizes)]
    built = (codecs, alignment, mask_E, index, token_mask)
    _BUILT[key] = (tokenizers, built)
    return built


# (tokenizer id, union digests) -> (tokenizer, EventTokens): each member's tokens for
# every union event, built once per process (the value keeps the tokenizer alive).
_EVENT_TOKENS: dict[tuple, tuple] = {}


class EventTokens(NamedTuple):
    """A member's tokens for every union event, as a ragged table.

    Attributes:
        starts: int32 [U]: where event u's tokens begin in ``flat``.
        lengths: int32 [U]: how many (0: CONTROL; -1: the member cannot encode
            the event's bytes losslessly, which `brf.align.reencode` refuses).
        flat: int32: the tokens, event after event.
    """
    starts: np.ndarray
    lengths: np.ndarray
    flat: np.ndarray


def event_tokens(codec, union) -> EventTokens:
    """Member tokens for every event: ``encode_bytes(codec, bytes(u))``, all at once.

    In fused decoding every member reads every event right after it is drawn, so
    ``brf.align.reencode`` with every token frozen encodes the new bytes on their
    own: a function of the event alone. That makes the map a table the compiled
    step can read on the device (`brf.ensemble.step`). Valid UTF-8 strings go
    through the tokenizer in one batch; the few that are not (byte tokens) and
    any whose encoding does not decode back to them go through
    ``encode_bytes`` one by one, exactly as reencode would. Built once per
    process; for large union spaces (the shipped pair's 258,776 events) also
    kept in ``$BRF_CACHE/align``, keyed by the member's and the union's digests.
    """
    key = (id(codec.tokenizer), union.digests, union.size)
    hit = _EVENT_TOKENS.get(key)
    if hit is not None:
        return hit[1]
    path = _event_tokens_path(codec, union)
    if path is not None and os.path.exists(path):
        try:
            with np.load(path) as z:
                out = EventTokens(z["starts"], z["lengths"], z["flat"])
            if len(out.starts) == union.size:
                _EVENT_TOKENS[key] = (codec.tokenizer, out)
                return out
        except (OSError, ValueError, KeyError):
            pass  # a damaged file is rebuilt
    out = _encode_events(codec, union)
    _EVENT_TOKENS[key] = (codec.tokenizer, out)
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp.npz"
            np.savez(tmp, starts=out.starts, lengths=out.lengths, flat=out.flat)
            os.replace(tmp, path)
        except OSError:
            pass  # a cache that cannot be written only costs time
    return out


# Union spaces with more events than this keep their event tokens on disk
# (``$BRF_CACHE/align``): building them encodes every event with the tokenizer.
_DISK_ABOVE = 50_000


def _event_tokens_path(codec, union) -> str | None:
    if union.size <= _DISK_ABOVE:
        return None
    import hashlib
    from brf.align.union import default_cache_dir
    # The token table's digest does not cover how text is split (merges,
    # normalisers, pre-tokenizers): the tokenizer's own serialisation does.
    backend = getattr(codec.tokenizer, "backend_tokenizer", codec.tokenizer)
    try:
        rules = hashlib.sha256(backend.to_str().encode()).hexdigest()
    except AttributeError:
        return None
    # "text": the events are encoded as text (special strings as characters, issue 71);
    # files from before that rule are not read.
    key = hashlib.sha256("/".join(("text", codec.table.digest, rules)
                                  + tuple(union.digests)).encode())
    return os.path.join(default_cache_dir(), f"events-{key.hexdigest()[:24]}.npz")


def _encode_events(codec, union) -> EventTokens:
    """`event_tokens` computed: a batch encode, then the exceptions one by one."""
    from brf.align.reencode import encode_bytes
    strings = union.strings
    texts, which = [], []
    for u, data in enumerate(strings):
        if u == align.CONTROL or not data:
            continue
        try:
            texts.append(data.decode("utf-8"))
            which.append(u)
        except UnicodeDecodeError:
            pass
    ids: list = [()] * len(strings)
    # text in the middle of a string: without a dummy prefix (`brf.align.reencode`)
    encoder = codec.mid if codec.mid is not None else codec.tokenizer
    for u, enc in zip(which, encode_texts(encoder, texts)):
        ids[u] = tuple(enc)
    lengths = np.zeros(len(strings), np.int32)
    decode = codec.table.decode
    for u, data in enumerate(strings):
        if u == align.CONTROL or not data:
            continue
        if not ids[u] or decode(ids[u]) != data:
            try:
                ids[u] = tuple(encode_bytes(codec, data))
            except ValueError:
                ids[u], lengths[u] = (), -1
                continue
        lengths[u] = len(ids[u])
    starts = np.zeros(len(strings), np.int32)
    starts[1:] = np.cumsum(np.maximum(lengths, 0))[:-1]
    flat = np.fromiter((t for seq in ids for t in seq), np.int32)
    return EventTokens(starts, lengths, flat if flat.size else np.zeros(1, np.int32))


class AlignedSpace:
    """Events of a ``brf.align`` aligner; text as bytes; stable re-encoding per member."""

    def __init__(self, aligner: str, members: Sequence[Member], batch: int,
                 aligner_params: dict | None = None, prompt_ids=None):
        if aligner not in align.ALIGNERS:
            raise EnsembleInputError(f"unknown aligner {aligner!r}; known: "
                                     f"{', '.join(align.ALIGNERS.names())}")
        self.name = aligner
        self.members = list(members)
        self.params = dict(aligner_params or {})
        built = _build(aligner, tuple(m.tokenizer for m in members),
                       tuple(m.cfg.vocab_size for m in members))
        self.codecs, self.alignment, self.mask_E, self._index, self._token_mask = built
        self.union = self.alignment.union
        self.supports_mixture = aligner in ("union", "identity")
        self.size = self.union.size if self.union is not None else self.codecs[0].table.size
        self.bytes = [b""] * batch
        self.states = None  # per member, per sequence: brf.align MemberText

    def start(self, prompt_ids: Sequence[Sequence[Sequence[int]]]) -> None:
        """Per member and sequence, the prompt tokens (frozen up to the last control token)."""
        self.states = [[align.from_ids(c, ids) for ids in per_b]
                       for c, per_b in zip(self.codecs, prompt_ids)]

    def lead_pending(self) -> bool:
        """Whether some member's prompt still lacks its dummy prefix (`brf.align.from_ids`):
        its first event's tokens then spell the prefix and the event."""
        return any(len(st.text) > (st.ends[-1] if st.ends else 0)
                   for per_b in self.states for st in per_b)

    def _vocab(self, i, logits_BxV):
        return logits_BxV[:, :self.codecs[i].table.size]  # drop padding rows of the head

    def align_all(self, logits: Sequence[jax.Array]):
        out = self.alignment([self._vocab(i, l) for i, l in enumerate(logits)], **self.params)
        events = None if self.name in ("union", "identity") else out.events_XE
        return out.logp_XnE, events

    def align_one(self, i: int, logits_BxV: jax.Array) -> jax.Array:
        if self.name == "identity":
            return jax.nn.log_softmax(self._vocab(i, logits_BxV), axis=-1)
        if self.name != "union":
            raise EnsembleInputError(f"aligner {self.name!r} scores events from every member's "
                                     "distribution; mixture sampling needs 'union'")
        dev = self.alignment.table
        return _union_one(self._vocab(i, logits_BxV), dev.index[i], num_events=self.size)

    def token_mask(self, i: int):
        """bool [V_i]: member i's tokens whose event every member can read (head padding: False)."""
        return self._token_mask[i] if self.name == "union" else None

    def token_events(self, i: int, tokens_B):
        """Member i's token ids -> union event ids."""
        if self.name != "union":
            return np.asarray(tokens_B)
        return self._index[i][np.asarray(tokens_B)]

    def is_eos(self, event: int) -> bool:
        return self.alignment.is_control(int(event))

    def advance(self, b: int, event: int, n_read: Sequence[int]):
        data = self.alignment.event_bytes(int(event))
        self.bytes[b] += data
        out = []
        for i, c in enumerate(self.codecs):
            st = align.reencode(c, self.states[i][b], data, frozen=n_read[i])
            self.states[i][b] = st.state
            out.append((st.n_retract, st.pending))
        return out

    def text(self, b: int) -> str:
        return self.bytes[b].decode("utf-8", errors="replace")

    def raw(self, b: int) -> bytes:
        return self.bytes[b]

    def member_ids(self, i: int, b: int) -> tuple[int, ...]:
        """Member i's token ids for sequence b (prompt and generated text)."""
        return self.states[i][b].ids
