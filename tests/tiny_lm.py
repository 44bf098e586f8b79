"""Tiny random language models with real (tiny) tokenizers, for ensemble tests.

``tiny_tokenizer`` builds a byte-level BPE (every byte is a token, so any text
round-trips) with a few merges; different merge lists give different
vocabularies. ``tiny_member`` pairs it with a random 2-layer model whose logits
are scaled up so its next-token distributions are peaked (random models with
std-0.02 weights are nearly uniform, which makes statistical tests weak).
"""

from __future__ import annotations

import dataclasses

import jax
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from brf.ensemble.member import Member
from brf.models import ModelConfig, init_params

SPECIALS = ("<pad>", "<s>", "</s>")
DEFAULT_MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"),
                  ("e", "r"), ("o", "n"), ("Ġ", "s"))
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")


def tiny_tokenizer(merges=DEFAULT_MERGES, specials=SPECIALS, eos: str = "</s>",
                   bos: str = "<s>", add_bos: bool = True):
    """A byte-level BPE fast tokenizer: specials, the 256 byte symbols, then merges."""
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return TokenizersBackend(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                             pad_token="<pad>", add_bos_token=add_bos,
                             chat_template=CHAT_TEMPLATE)


def tiny_config(vocab_size: int, max_seq_len: int = 256, eos_id: int = 2) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, head_dim=8, d_ff=64, norm_eps=1e-6, rope_theta=10000.0,
                       max_seq_len=max_seq_len, tie_embeddings=False, bos_id=1, eos_ids=(eos_id,), pad_id=0)


def tiny_params(cfg: ModelConfig, seed: int, sharpness: float = 20.0):
    """Random params with the final norm scaled so logits have std of a few nats."""
    params = init_params(cfg, jax.random.PRNGKey(seed))
    params["final_norm"] = params["final_norm"] * sharpness
    return params


def tiny_member(seed: int = 0, tokenizer=None, name: str | None = None, max_seq_len: int = 256,
                **kwargs) -> Member:
    tokenizer = tokenizer or tiny_tokenizer()
    cfg = tiny_config(len(tokenizer), max_seq_len, eos_id=tokenizer.eos_token_id)
    return Member(name=name or f"tiny{seed}", cfg=cfg, params=tiny_params(cfg, seed),
                  tokenizer=tokenizer, **kwargs)


def tiny_pair(tokenizer) -> list[Member]:
    """Two different random models sharing one tokenizer ('a' and 'b')."""
    return [tiny_member(0, tokenizer, name="a"), tiny_member(1, tokenizer, name="b")]


# Another byte-level BPE vocabulary over the same text ("the cat sat"...): the second
# member of a cross-vocabulary pair.
OTHER_MERGES = (("a", "b"), ("Ġ", "c"), ("Ġc", "at"), ("a", "t"), ("t", "h"), ("th", "e"),
                ("Ġ", "the"), ("Ġ", "th"), ("Ã", "©"), ("c", "a"), ("ca", "f"))


def tiny_cross_pair(tokenizer) -> list[Member]:
    """Two different random models with different byte-level BPE vocabularies ('a' on
    ``tokenizer``, 'b' on :data:`OTHER_MERGES`)."""
    return [tiny_member(0, tokenizer, name="a"),
            tiny_member(1, tiny_tokenizer(OTHER_MERGES), name="b")]


def prompt_ensemble(member: Member) -> list[Member]:
    """One model under two conditioning prefixes (a prompt ensemble: one group)."""
    return [dataclasses.replace(member, name="plain", prefix="the "),
            dataclasses.replace(member, name="other", prefix="a hat in ")]
