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

`load_tokenizer(name)` builds a registered model's tokenizer from its GGUF
metadata only (no weights are read), once per process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from typing import Any, NamedTuple

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


@functools.lru_cache(maxsize=None)
def load_tokenizer(source: str | os.PathLike) -> Any:
    """The tokenizer of a registered model name or a model path, without its weights.

    Uses `brf.checkpoints.tokenizer.load_tokenizer` on the resolved source: for
    a GGUF file only its metadata is read (Gemma 3's 262k-token tokenizer still
    takes ~10 s to build, hence the per-process cache).
    """
    from brf.checkpoints.registry import resolve
    from brf.checkpoints.tokenizer import load_tokenizer as _load
    return _load(resolve(source))


@functools.lru_cache(maxsize=None)
def load_token_table(source: str | os.PathLike) -> TokenTable:
    """`token_table(load_tokenizer(source))`, once per process."""
    return token_table(load_tokenizer(source))


__all__ = ["BYTE_LEVEL", "SENTENCEPIECE", "TokenTable", "bytes_to_unicode", "decoder_kind",
           "load_token_table", "load_tokenizer", "token_table"]
