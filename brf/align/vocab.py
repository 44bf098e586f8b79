"""What each token of a vocabulary decodes to, as exact bytes.

Alignment keys tokens by the byte string they decode to, so the first job is a
table `id -> bytes` per tokenizer. It is read off the tokenizer's vocabulary
and decoder, not off `tokenizer.decode`, because decode returns `str` and turns
a lone byte of a multi-byte character into U+FFFD:

* **byte-level BPE** (decoder `ByteLevel`, GPT-2 / SmolLM2): every character of
  a token string stands for one byte through GPT-2's byte-to-unicode table
  (`Ġ` = 0x20, `Ċ` = 0x0A, `â` = 0xE2, ...); the token's bytes are the inverse
  map applied character by character. All 256 single bytes are tokens.
* **SentencePiece-style BPE** (decoder `Replace('▁', ' ')` + `ByteFallback`,
  Llama / Gemma): `<0xNN>` is the single byte NN; any other token is its
  string with `▁` replaced by a space, encoded as UTF-8.

Control tokens -- every *special* added token (BOS, EOS, PAD, UNK, chat markers
such as `<|im_end|>` / `<end_of_turn>`, Gemma's `<unusedN>`) -- are not text.
They get the empty byte string and `control=True`; the union aligner pools them
in one CONTROL event (see `brf.align.union`). Non-special added tokens
(Gemma's user-defined `\\n\\n`, `<table>`, ...) are text and keep their bytes.
A decoder `Strip` step (Llama's removal of the leading space at the start of a
text) is position dependent and ignored: the table gives a token's bytes in
the middle of a text. Decoders this module does not know raise ValueError.

Text is text: `encode_text` encodes a text as the characters it holds. A
corpus, a prompt or a prefix that contains the *characters* of a special token
(`<|im_start|>`, `<bos>`) gets the tokens that spell those characters, never
the control token (a tokenizer called directly matches them as control
tokens). Control tokens come only from a template (`encode_template`: a chat
template or a member's prompt template, whose own markers stay control tokens
while the text filled into it stays text) and from the tokenizer's BOS / EOS
rules (`add_special_tokens=True`).

`load_tokenizer(name)` builds a registered model's tokenizer from its GGUF
metadata only (no weights are read), once per process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import uuid
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (256 entries).

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls,
    space, 0x7F-0xA0, 0xAD) map to U+0100 upwards in byte order, so 0x20 -> 'Ġ'
    and 0x0A -> 'Ċ'.
    """
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=None)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenTable(NamedTuple):
    """The exact bytes every token of one vocabulary decodes to.

    Attributes:
        kind: BYTE_LEVEL or SENTENCEPIECE (how token strings were read).
        token_bytes: token id -> bytes; b"" for control tokens.
        control_V: bool [V], True for control (special) tokens.
        digest: SHA-256 (hex) of kind, token_bytes and control_V; keys caches.
    """

    kind: str
    token_bytes: tuple[bytes, ...]
    control_V: np.ndarray
    digest: str

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def decode(self, ids) -> bytes:
        """The bytes a sequence of token ids decodes to (control tokens add none)."""
        return b"".join(self.token_bytes[int(i)] for i in ids)

    def byte_tokens(self) -> np.ndarray:
        """int32 [256]: a non-control token id decoding to each single byte (-1: none).

        Where several tokens decode to the same byte (SentencePiece 'a' and
        '<0x61>'), the lowest id of a `<0xNN>`-style / byte-map token wins --
        the one the tokenizer itself emits for a byte it cannot merge.
        """
        out = np.full(256, -1, np.int32)
        for i in range(self.size - 1, -1, -1):  # lowest id wins
            b = self.token_bytes[i]
            if len(b) == 1 and not self.control_V[i]:
                out[b[0]] = i
        return out


def _digest(kind: str, token_bytes, control_V) -> str:
    h = hashlib.sha256(kind.encode())
    h.update(np.asarray([len(b) for b in token_bytes], np.int64).tobytes())
    h.update(b"".join(token_bytes))
    h.update(np.packbits(control_V).tobytes())
    return h.hexdigest()


def _backend(tokenizer: Any):
    """A `tokenizers.Tokenizer` from it or from a transformers fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "get_added_tokens_decoder"):
        raise TypeError(f"need a tokenizers.Tokenizer or a transformers fast tokenizer, got "
                        f"{type(tokenizer).__name__}")
    return backend


def decoder_kind(tokenizer: Any) -> str:
    """BYTE_LEVEL or SENTENCEPIECE, read off the tokenizer's decoder.

    Raises:
        ValueError: no decoder, or one that is neither (named).
    """
    dec = _backend(tokenizer).decoder
    if dec is None:
        raise ValueError("the tokenizer has no decoder; cannot tell how tokens map to bytes")
    spec = json.loads(dec.__getstate__())
    parts = spec.get("decoders", [spec]) if spec["type"] == "Sequence" else [spec]
    types = [p["type"] for p in parts]
    if "ByteLevel" in types:
        return BYTE_LEVEL
    replaces_marker = any(p["type"] == "Replace" and p.get("pattern", {}).get("String") == "▁"
                          for p in parts)
    if replaces_marker or "ByteFallback" in types or "Metaspace" in types:
        return SENTENCEPIECE
    raise ValueError(f"unsupported tokenizer decoder {types}; brf.align reads byte-level BPE "
                     "(ByteLevel) and SentencePiece-style (Replace '▁' / ByteFallback) ones")


def _sentencepiece_bytes(piece: str) -> bytes:
    m = _BYTE_FALLBACK.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")


def _byte_level_bytes(piece: str) -> bytes:
    inv = _unicode_to_byte()
    try:
        return bytes(inv[c] for c in piece)
    except KeyError:  # a non-special added token stored as plain text
        return piece.encode("utf-8")


def token_table(tokenizer: Any) -> TokenTable:
    """Reads the exact byte string of every token of a tokenizer.

    Args:
        tokenizer: a `tokenizers.Tokenizer` or a transformers fast tokenizer.

    Returns:
        The TokenTable (control tokens: b"" and control_V True).

    Raises:
        ValueError: unsupported decoder, or token ids that are not 0..V-1.
    """
    backend = _backend(tokenizer)
    kind = decoder_kind(backend)
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    if size != len(vocab):
        raise ValueError(f"token ids are not contiguous: {len(vocab)} tokens, max id {size - 1}")
    pieces = [""] * size
    for piece, i in vocab.items():
        pieces[i] = piece
    control_V = np.zeros(size, bool)
    added = backend.get_added_tokens_decoder()
    for i, tok in added.items():
        if tok.special:
            control_V[i] = True
    read = _byte_level_bytes if kind == BYTE_LEVEL else _sentencepiece_bytes
    token_bytes = []
    for i, piece in enumerate(pieces):
        if control_V[i]:
            token_bytes.append(b"")
        elif i in added and kind == BYTE_LEVEL:
            token_bytes.append(piece.encode("utf-8"))  # added tokens are stored as text
        else:
            token_bytes.append(read(piece))
    token_bytes = tuple(token_bytes)
    return TokenTable(kind, token_bytes, control_V, _digest(kind, token_bytes, control_V))


@contextlib.contextmanager
def _plain(backend):
    """The backend with special-token matching off: a special token's characters in
    the text are encoded as text (`tokenizers`' `encode_special_tokens`)."""
    was = backend.encode_special_tokens
    backend.encode_special_tokens = True
    try:
        yield backend
    finally:
        backend.encode_special_tokens = was


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """The token ids of ``text`` read as text: a special token's characters in it are
    those characters, never the control token.

    Args:
        tokenizer: a `tokenizers.Tokenizer` or a transformers fast tokenizer.
        text: the text.
        add_special_tokens: add what the tokenizer's own rules add around a text
            (BOS, and EOS where it is told to), as ``tokenizer(text)`` does.

    Returns:
        The ids; without ``add_special_tokens`` they decode to exactly the text's
        bytes (`token_table(tokenizer).decode`) wherever the vocabulary spells it.
    """
    with _plain(_backend(tokenizer)) as backend:
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """`encode_text` of many texts in one batch call (no BOS / EOS added)."""
    with _plain(_backend(tokenizer)) as backend:
        return [list(e.ids) for e in backend.encode_batch(list(texts),
                                                          add_special_tokens=False)]


def _special_strings(backend) -> tuple[str, ...]:
    """The special added tokens' strings, longest first (the ones matched in text)."""
    added = backend.get_added_tokens_decoder().values()
    return tuple(sorted({t.content for t in added if t.special and t.content},
                        key=len, reverse=True))


def encode_template(tokenizer: Any, render: Callable[[Mapping[str, str]], str],
                    fields: Mapping[str, str], *, add_special_tokens: bool = False
                    ) -> list[int]:
    """The ids of a rendered template whose markers are control tokens and whose
    filled-in fields are text.

    ``render(fields)`` gives the text (a chat template applied to messages, a
    format string filled). Special-token strings the template writes itself
    (``<|im_start|>``, ``<start_of_turn>``) become control tokens; those inside a
    field's value are encoded as their characters (`encode_text`). When no field
    holds a special token's string, the ids are the tokenizer's own for the
    rendered text.

    Args:
        tokenizer: a `tokenizers.Tokenizer` or a transformers fast tokenizer.
        render: fields -> the template's text.
        fields: the values filled in (user text).
        add_special_tokens: as in `encode_text`.
    """
    backend = _backend(tokenizer)
    specials = _special_strings(backend)
    if not any(s in v for v in fields.values() for s in specials):
        return list(backend.encode(render(fields), add_special_tokens=add_special_tokens).ids)
    # Each special string inside a field is hidden behind a marker no tokenizer
    # matches; the template is split at the control tokens the tokenizer finds in
    # what remains (the template's own), and the text between them, markers put
    # back, is encoded as text.
    nonce = uuid.uuid4().hex
    hidden: dict[str, str] = {}

    def hide(m: re.Match) -> str:
        key = f"\ue000{nonce}{len(hidden)}\ue001"
        hidden[key] = m.group(0)
        return key

    pattern = re.compile("|".join(re.escape(s) for s in specials))
    rendered = render({k: pattern.sub(hide, v) for k, v in fields.items()})
    back = re.compile(f"\ue000{nonce}\\d+\ue001")
    control = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    pieces, start = [], 0
    whole = backend.encode(rendered, add_special_tokens=False)

    def text(a: int, b: int):
        if b > a:
            piece = back.sub(lambda m: hidden[m.group(0)], rendered[a:b])
            with _plain(backend):
                pieces.append(backend.encode(piece, add_special_tokens=False))

    for i, (a, b) in zip(whole.ids, whole.offsets):
        if i in control:
            text(start, a)
            pieces.append(backend.encode(rendered[a:b], add_special_tokens=False))
            start = b
    text(start, len(rendered))
    from tokenizers import Encoding
    merged = Encoding.merge(pieces) if pieces else backend.encode("", add_special_tokens=False)
    if add_special_tokens:
        merged = backend.post_process(merged, add_special_tokens=True)
    return list(merged.ids)


@functools.lru_cache(maxsize=None)
def load_tokenizer(source: str | os.PathLike) -> Any:
    """The tokenizer of a registered model name or a model path, without its weights.

    Uses `brf.checkpoints.tokenizer.load_tokenizer` on the resolved source: for
    a GGUF file only its metadata is read (Gemma 3's 262k-token tokenizer still
    takes ~10 s to build, hence the per-process cache).
    """
    from brf.checkpoints.registry import orphan_checkpoint, resolve
    from brf.checkpoints.tokenizer import load_tokenizer as _load
    try:
        return _load(resolve(source))
    except FileNotFoundError:  # a registered model's source gone: its cached checkpoint
        ckpt = orphan_checkpoint(os.fspath(source))
        if ckpt is None or not os.path.isdir(os.path.join(ckpt, "tokenizer")):
            raise
        return _load(os.path.join(ckpt, "tokenizer"))


@functools.lru_cache(maxsize=None)
def load_token_table(source: str | os.PathLike) -> TokenTable:
    """`token_table(load_tokenizer(source))`, once per process."""
    return token_table(load_tokenizer(source))


__all__ = ["BYTE_LEVEL", "SENTENCEPIECE", "TokenTable", "bytes_to_unicode", "decoder_kind",
           "encode_template", "encode_text", "encode_texts", "load_token_table",
           "load_tokenizer", "token_table"]
