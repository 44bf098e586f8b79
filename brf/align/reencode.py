"""Re-encoding chosen text into each member's own tokens, stably.

After the ensemble picks an event (a byte string), every member must turn it
into its own tokens. Encoding the new string on its own is wrong at the
boundary: BPE merges across it (' the' then 'ory' is one token ' theory' for a
tokenizer that has it), and a multi-byte character may arrive one byte per
step. brf keeps every member on the *canonical* tokenization of the whole text
so far, i.e. `state.ids == encode_bytes(codec, state.text)`, and computes the
change cheaply:

1. Suffix window. Take the last `lookback` committed tokens; the window starts
   at the byte where the first of them starts (a token boundary).
2. Re-tokenize the window text (old suffix + new bytes) and compare with the
   committed tokens of the window: their longest common prefix (LCP) is the
   stable part.
3. Trust check. The window start is accepted as a fixed boundary when the
   re-tokenized window reproduces at least its first committed token (LCP >= 1);
   otherwise the window is doubled (up to the whole text, which is exact, or
   up to the frozen prompt prefix of `from_ids`).
4. Result: `n_retract` = committed tokens after the stable prefix (they must be
   removed from the member's KV cache: a cache rollback of n_retract positions)
   and `pending` = the window's tokens after the LCP, which the member feeds in
   its next catch-up pass. Committed tokens before the window never change.

Usually n_retract = 0 and `pending` is exactly what appending gives; when the
new text merges with the end of the old (' the' + 'ory'), the tail is retracted
and replaced, so the member always conditions on its own tokenizer's encoding
of the text -- never on a split it would not have produced.

With lazy catch-up a member has read only some of its tokens; the rest are
pending. Pass `frozen=<tokens already read>`: retraction then only touches
pending tokens (free: drop them from the pending list), the read ones are a
hard boundary, and the text after them is encoded canonically on its own.
`frozen=len(state.ids)` never retracts at all (pure appending).

`encode_bytes` is the canonical encoding of *bytes*: maximal valid UTF-8 runs
go through the tokenizer (no BOS/EOS added); bytes that are not valid UTF-8 (a
character cut after its first byte, or a stray byte token) are single byte
tokens (`<0xNN>` / the byte-level byte). A character completed by a later step
is then retracted and re-encoded as a whole. Text is text: the characters of a
special token (e.g. '<|im_end|>') are encoded as those characters
(`brf.align.vocab.encode_text`), never as the control token. `reencode` raises
ValueError for bytes a member's vocabulary cannot express (SmolLM2 has no token
for 0x04, 0xC0, 0xF5..0xFF, ...).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from brf.align.vocab import TokenTable, encode_text, token_table


class Codec(NamedTuple):
    """A member's tokenizer and its byte table.

    Attributes:
        tokenizer: transformers fast tokenizer or tokenizers.Tokenizer.
        table: its TokenTable.
        byte_ids: int32 [256]: the token for each lone byte (-1: none).
    """

    tokenizer: Any
    table: TokenTable
    byte_ids: np.ndarray


def make_codec(tokenizer: Any, table: TokenTable | None = None) -> Codec:
    """Bundles a tokenizer with its TokenTable (built if not given)."""
    table = table if table is not None else token_table(tokenizer)
    return Codec(tokenizer, table, table.byte_tokens())


class MemberText(NamedTuple):
    """One member's view of the text so far.

    Attributes:
        text: all bytes so far.
        ids: the member's tokens for them (canonical: `encode_bytes(text)`
            after the first `floor` tokens).
        ends: byte offset where each token ends (ends[-1] == len(text)).
        floor: the first `floor` ids are frozen and never re-encoded (a prompt
            with control tokens, e.g. a chat template; see `from_ids`).
    """

    text: bytes = b""
    ids: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()
    floor: int = 0


class Step(NamedTuple):
    """The result of `reencode`.

    Attributes:
        state: the member's new MemberText.
        n_retract: how many committed tokens to drop from the end (cache rollback).
        pending: the new tokens to feed after the rollback.
    """

    state: MemberText
    n_retract: int
    pending: tuple[int, ...]


def encode_bytes(codec: Codec, data: bytes) -> list[int]:
    """The canonical token ids of arbitrary bytes (see the module docstring).

    Raises:
        ValueError: the result does not decode back to `data` (bytes the
            vocabulary lacks).
    """
    if not data:
        return []
    text = data.decode("utf-8", errors="surrogateescape")
    ids: list[int] = []
    run: list[str] = []

    def flush():
        if run:
            ids.extend(encode_text(codec.tokenizer, "".join(run)))
            run.clear()

    for ch in text:
        if "\udc80" <= ch <= "\udcff":  # an invalid byte, escaped by surrogateescape
            flush()
            b = ord(ch) - 0xDC00
            if codec.byte_ids[b] < 0:
                raise ValueError(f"the vocabulary has no token for the byte {b:#04x}")
            ids.append(int(codec.byte_ids[b]))
        else:
            run.append(ch)
    flush()
    if codec.table.decode(ids) != data:
        raise ValueError(f"the tokenizer cannot express {data!r} losslessly (got "
                         f"{codec.table.decode(ids)!r}): bytes outside its vocabulary")
    return ids


def check_reencodable(codec: Codec, name: str = "the tokenizer") -> None:
    """Refuses a tokenizer that puts a space before every text it encodes (a
    SentencePiece dummy prefix: Llama 2, Mistral 7B, Phi-3): its encoding of text
    from the middle of a generation decodes with a space the text lacks, so it
    cannot keep a member on the text's bytes (`encode_bytes` would fail at the
    first re-encoding).

    Raises:
        ValueError: naming `name` and what to use instead.
    """
    ids = encode_text(codec.tokenizer, "a")
    got = codec.table.decode(ids)
    if got != b"a" and got.endswith(b"a") and got[:-1].strip() == b"":
        raise ValueError(f"{name} puts a space before every text (a SentencePiece dummy "
                         f"prefix: 'a' reads {got!r}), so text chosen by the ensemble cannot "
                         "be re-encoded into its tokens losslessly; use it with members of its "
                         "own vocabulary (aligner='identity'), not across tokenizers or bytes")


def _ends(codec: Codec, ids, start: int = 0) -> list[int]:
    out, pos = [], start
    for i in ids:
        pos += len(codec.table.token_bytes[i])
        out.append(pos)
    return out


def start(codec: Codec, text: bytes = b"") -> MemberText:
    """A member's state for a prompt (encoded whole, canonically)."""
    ids = encode_bytes(codec, text)
    return MemberText(text, tuple(ids), tuple(_ends(codec, ids)))


def from_ids(codec: Codec, ids) -> MemberText:
    """A member's state for prompt tokens it already has (e.g. a rendered chat template).

    Everything up to and including the last control token is frozen (`floor`):
    control tokens have no bytes, so re-encoding text can never reproduce them.
    """
    ids = tuple(int(i) for i in ids)
    control = [j for j, i in enumerate(ids) if codec.table.control_V[i]]
    floor = control[-1] + 1 if control else 0
    return MemberText(codec.table.decode(ids), ids, tuple(_ends(codec, ids)), floor)


def reencode(codec: Codec, state: MemberText, new: bytes, lookback: int = 4,
             frozen: int = 0) -> Step:
    """Appends `new` bytes to a member's text and re-encodes the boundary stably.

    Args:
        codec: the member's tokenizer (`make_codec`).
        state: its MemberText before the step.
        new: the chosen string's bytes.
        lookback: committed tokens re-tokenized with the new bytes (doubled
            when the window boundary is not stable).
        frozen: the first `frozen` ids may not change (the tokens the member
            has already read into its KV cache); then n_retract only ever
            drops tokens it has not read yet, and the text after them is
            encoded canonically on its own. `frozen=len(state.ids)` is pure
            appending (never retracts; tokenization may be non-canonical at
            the boundary, e.g. ' the' + 'ory').

    Returns:
        Step(state, n_retract, pending): drop the last n_retract committed
        tokens, then feed `pending`; state.ids is the result.

    Raises:
        ValueError: `new` cannot be expressed by this vocabulary.
    """
    if not new:
        return Step(state, 0, ())
    text = state.text + new
    ids, ends = state.ids, state.ends
    back = max(1, lookback)
    floor = min(max(state.floor, int(frozen)), len(ids))
    while True:
        j0 = max(floor, len(ids) - back)
        b0 = ends[j0 - 1] if j0 else 0
        window = encode_bytes(codec, text[b0:])
        old = ids[j0:]
        lcp = 0
        while lcp < min(len(window), len(old)) and window[lcp] == old[lcp]:
            lcp += 1
        if j0 == floor or lcp >= 1:
            break
        back *= 2
    keep = j0 + lcp
    pending = tuple(window[lcp:])
    kept_end = ends[keep - 1] if keep else 0
    new_ids = ids[:keep] + pending
    new_ends = ends[:keep] + tuple(_ends(codec, pending, kept_end))
    return Step(MemberText(text, new_ids, new_ends, state.floor), len(ids) - keep, pending)


__all__ = ["Codec", "MemberText", "Step", "check_reencodable", "encode_bytes", "from_ids",
           "make_codec", "reencode", "start"]
