"""Brute-force byte-level probabilities, for the tests of brf.bytes.

Enumerates every token sequence that covers a byte string -- all but its last
token decode to a proper prefix of the string, the last one starts with the
rest -- by scanning the whole vocabulary with ``bytes.startswith`` (no trie),
and sums their probabilities. The next-token distributions come from full
forward passes without a KV cache (``brf.models.forward``), one per distinct
prefix, conditioned on text tokens + EOS as brf.bytes.masses documents:
q(t | T) = p(t | T) / (sum of text tokens' p + sum of EOS tokens' p).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from brf.align.vocab import bytes_to_unicode
from brf.models import ModelConfig, forward, init_params

SPECIALS = ("<pad>", "<s>", "</s>")


def _backend(tok: Tokenizer) -> TokenizersBackend:
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return TokenizersBackend(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                             pad_token="<pad>")


def byte_level_tokenizer() -> TokenizersBackend:
    """A byte-level BPE: 3 specials, the 256 bytes, merges, and 'abc' (never canonical).

    Merges b+c before a+b, so the canonical tokens of 'abc' are 'a' 'bc' while
    a greedy longest match would take 'ab' 'c'; 'Ã' + '©' is 'é' (a token for a
    two-byte character; 'é' can also be read as its two byte tokens), 'â' + 'Ĥ'
    is the first two bytes of '€' (a token ending inside a character).
    """
    b2u = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    merges = [("b", "c"), ("a", "b"), ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©"),
              ("â", "Ĥ"), ("Ċ", "Ċ")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["abc"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return _backend(tok)


def sentencepiece_tokenizer() -> TokenizersBackend:
    """A SentencePiece-style BPE: '▁' for spaces, <0xNN> byte fallback for what the
    pieces lack ('€' is three byte tokens), 'a' and '<0x61>' both decode to b'a'."""
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "t", "h", "e", "a", "b", "c", "é", "\n"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("b", "c"), ("a", "b"), ("▁", "▁")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, byte_fallback=True,
                               fuse_unk=False))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return _backend(tok)


def tiny_model(vocab_size: int, seed: int = 0, dtype=jnp.float32, sharpness: float = 20.0,
               max_seq_len: int = 512):
    """A random 2-layer Llama (BOS 1, EOS 2) whose logits have a few nats of spread."""
    cfg = ModelConfig(arch="llama", vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, d_ff=64, norm_eps=1e-6, rope_theta=10000.0,
                      max_seq_len=max_seq_len, tie_embeddings=False, bos_id=1, eos_ids=(2,),
                      pad_id=0)
    params = init_params(cfg, jax.random.PRNGKey(seed), dtype)
    params["final_norm"] = params["final_norm"] * sharpness
    return cfg, params


class BruteForce:
    """Covers of short strings under one model (memoised next-token distributions)."""

    def __init__(self, params, cfg, table, ctx, dtype=jnp.float32, eos_ids=None):
        self.params, self.cfg, self.ctx, self.dtype = params, cfg, list(ctx), dtype
        self.tb = table.token_bytes
        self.text = np.asarray([i for i, (b, c) in enumerate(zip(self.tb, table.control_V))
                                if b and not c])
        self.eos = list(cfg.eos_ids if eos_ids is None else eos_ids)
        self.memo: dict[tuple, np.ndarray] = {}
        self.passes = 0

    def _fill(self, seqs: list[tuple]) -> None:
        """Next-token distributions after each sequence: batched forward passes
        (rows padded to a multiple of 8 tokens, batches to 16 rows, so that few
        shapes compile)."""
        todo = [s for s in dict.fromkeys(seqs) if s not in self.memo]
        for i in range(0, len(todo), 16):
            self._fill_batch(todo[i:i + 16])

    def _fill_batch(self, todo: list[tuple]) -> None:
        if not todo:
            return
        width = -(-(len(self.ctx) + max(len(s) for s in todo)) // 8) * 8
        toks = np.zeros((16, width), np.int32)
        valid = np.zeros((16, width), bool)
        valid[:, 0] = True  # padding rows: one token, ignored
        for r, s in enumerate(todo):
            row = self.ctx + list(s)
            toks[r, :len(row)] = row
            valid[r, :len(row)] = True
        logits, _ = forward(self.params, self.cfg, jnp.asarray(toks), jnp.asarray(valid),
                            dtype=self.dtype)
        rows = np.asarray([len(self.ctx) + len(s) - 1 for s in todo])
        logits = np.asarray(logits[np.arange(len(todo)), rows], np.float64)
        for r, s in enumerate(todo):
            x = logits[r]
            p = np.exp(x - x.max())
            p /= p.sum()
            self.memo[s] = p / (p[self.text].sum() + p[self.eos].sum())
        self.passes += len(todo)

    def _matching(self, rest: bytes):
        """(tokens that are a proper prefix of rest, tokens that start with rest)."""
        inner, last = [], []
        for t in self.text:
            b = self.tb[t]
            if b.startswith(rest):
                last.append(t)
            elif rest.startswith(b):
                inner.append(t)
        return inner, last

    def prefix_prob(self, x: bytes) -> tuple[float, float]:
        """(P(x), P(x then end-of-text)) by enumerating every covering sequence."""
        inner_at = {j: self._matching(x[j:]) for j in range(len(x))}
        frontier = {(): 1.0}  # sequences decoding to x[:j], grouped by j below
        ends = {(): 0}
        total, eot, exact = 0.0, 0.0, {}
        while frontier:
            self._fill(list(frontier))
            nxt = {}
            for s, pr in frontier.items():
                q = self.memo[s]
                inner, last = inner_at[ends[s]]
                for t in last:
                    total += pr * q[t]
                    if self.tb[t] == x[ends[s]:]:
                        exact[s + (int(t),)] = pr * q[t]
                for t in inner:
                    s2 = s + (int(t),)
                    nxt[s2] = pr * q[t]
                    ends[s2] = ends[s] + len(self.tb[t])
            frontier = nxt
        self._fill(list(exact))
        for s, pr in exact.items():
            eot += pr * self.memo[s][self.eos].sum()
        return total, eot


__all__ = ["BruteForce", "byte_level_tokenizer", "sentencepiece_tokenizer", "tiny_model"]
