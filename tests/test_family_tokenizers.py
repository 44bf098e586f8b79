"""Tokenizers of the new families, trained here, through both readers and the byte view.

Two tiny tokenizers are trained on a small mixed corpus: a byte-level BPE with
Qwen2's pre-tokenizer (the kind Qwen2/3, OLMo 2 and Phi-4 ship) with
`tokenizers`' trainer, and a SentencePiece BPE with byte fallback (the kind of
Gemma 2 and Phi-3) with Google's `sentencepiece`. Each is checked as brf reads
it from a Hugging Face directory (tokenizer.json beside a tiny model of that
family, with its chat template) and from GGUF metadata written the way
llama.cpp's converter writes it:

* every text round-trips: the token ids' exact bytes (brf.align's table) are
  the text's UTF-8 bytes, for text the corpus never showed (emoji, CJK, control
  characters: byte-level symbols or <0xNN> byte fallback);
* the GGUF-built tokenizer gives the ids of the directory's (BPE) or of
  sentencepiece's own encoder (SentencePiece), and the same chat prompt;
* the family model's byte-level view (brf.bytes) gives each short string the
  probability of the brute-force sum over every token sequence covering it
  (tests/byte_reference.py), in float64.
"""

import io
import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # noqa: E402
from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: E402

from brf.align.vocab import BYTE_LEVEL, SENTENCEPIECE, token_table  # noqa: E402
from brf.bytes.lm import ByteLM, score_text  # noqa: E402
from brf.checkpoints import registry  # noqa: E402
from brf.checkpoints.tokenizer import tokenizer_from_dir, tokenizer_from_gguf  # noqa: E402
from brf.models import cast_params  # noqa: E402
from tests.byte_reference import BruteForce  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "Numbers 2024, 3.14159 and 1,000,000; versions v2.0.1 and x86_64.",
    "Merhaba dünya, nasılsın? Çok iyiyim, teşekkürler.",
    "   indented text\twith tabs\n\nand blank lines",
] * 20
TEXTS = [
    "The quick brown fox.", "  two  spaces,\ttab\nnewline", "def g(x): return x ** 2",
    "Emoji 🙂🤖 and CJK 東京 never seen", "Control \x00\x07 bytes", "½ × ∑ Ångström", "",
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TURNS = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
               "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Hi there"}]

# GGUF token types (llama.cpp's SentencePieceTokenTypes / gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def trained_bpe() -> TokenizersBackend:
    """A byte-level BPE trained on CORPUS, split as Qwen2's tokenizer.json splits."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return TokenizersBackend(tokenizer_object=tok, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", chat_template=CHATML)


# The special pieces of each family's vocabulary (Gemma's ids: pad 0, eos 1, bos 2,
# unk 3; Gemma adds no dummy prefix, Phi-3 / Llama do).
SPM_FAMILIES = {
    "gemma2": dict(add_dummy_prefix=False, pad_piece="<pad>", eos_piece="<eos>",
                   bos_piece="<bos>", unk_piece="<unk>",
                   control_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"]),
    "phi3": dict(add_dummy_prefix=True, pad_piece="<pad>", eos_piece="</s>", bos_piece="<s>",
                 unk_piece="<unk>", control_symbols=["<|user|>", "<|assistant|>", "<|end|>"]),
}


def trained_sentencepiece(arch: str):
    """A SentencePiece BPE with byte fallback trained on CORPUS, with `arch`'s specials."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=out, vocab_size=420, model_type="bpe",
        byte_fallback=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=1.0, pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, minloglevel=2, **SPM_FAMILIES[arch])
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def _write_tokenizer_gguf(path, arch, kv: dict, arrays: dict):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for key, value in arrays.items():
        w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def bpe_as_llamacpp_writes(tok: TokenizersBackend, path):
    """llama.cpp's _set_vocab_gpt2 for a Qwen2 checkpoint: tokens in id order, merges,
    control types for the special tokens, pre 'qwen2', no BOS."""
    state = json.loads(tok.backend_tokenizer.to_str())
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    special = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values()}
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    _write_tokenizer_gguf(path, "qwen2", {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.eos_token_id": tok.eos_token_id,
        "tokenizer.ggml.padding_token_id": tok.pad_token_id,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML,
    }, {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [CONTROL if t in special else NORMAL for t in tokens]})


def sentencepiece_as_llamacpp_writes(sp, arch, path):
    """llama.cpp's _set_vocab_sentencepiece: pieces, scores and types in id order."""
    n = sp.get_piece_size()
    types = [UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i)
             else BYTE if sp.is_byte(i) else NORMAL for i in range(n)]
    kv = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
          "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
          "tokenizer.ggml.unknown_token_id": sp.unk_id(),
          "tokenizer.ggml.padding_token_id": sp.pad_id(),
          "tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": GEMMA_TURNS}
    if arch == "gemma2":
        kv["tokenizer.ggml.add_space_prefix"] = False  # Gemma2Model.set_vocab
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, int) and value < 0:  # sentencepiece's -1: no such token
            continue
        (w.add_bool if isinstance(value, bool) else w.add_string if isinstance(value, str)
         else w.add_uint32)(key, value)
    w.add_array("tokenizer.ggml.tokens", [sp.id_to_piece(i) for i in range(n)])
    w.add_array("tokenizer.ggml.scores", [float(sp.get_score(i)) for i in range(n)])
    w.add_array("tokenizer.ggml.token_type", types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def _round_trips(tok, kind, lead=b""):
    """Every text's ids decode to its bytes; `lead`: the dummy prefix a SentencePiece
    tokenizer adds before a text (the byte table reads tokens as they are in the
    middle of a text, so the first one keeps that space)."""
    table = token_table(tok)
    assert table.kind == kind
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert table.decode(ids) == (lead + text.encode() if text else b""), text
        assert tok.decode(ids) == text, text
    return table


def test_byte_level_bpe_from_a_directory_and_from_gguf(tmp_path):
    """Qwen-style BPE: the directory's tokenizer and the GGUF-built one agree on every
    id, both round-trip every text's bytes, and both apply the ChatML template."""
    tok = trained_bpe()
    tok.save_pretrained(tmp_path / "dir")
    from_dir = tokenizer_from_dir(tmp_path / "dir")
    bpe_as_llamacpp_writes(tok, tmp_path / "tok.gguf")
    from_gguf = tokenizer_from_gguf(tmp_path / "tok.gguf")
    assert len(from_dir) == len(from_gguf) == len(tok)
    for t in (from_dir, from_gguf):
        _round_trips(t, BYTE_LEVEL)
    for text in TEXTS:
        assert from_gguf(text, add_special_tokens=False)["input_ids"] == \
            from_dir(text, add_special_tokens=False)["input_ids"], text
    want = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    for t in (from_dir, from_gguf):
        assert t.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == want
    assert from_gguf.eos_token == "<|im_end|>" and from_gguf.bos_token is None


@pytest.mark.parametrize("arch", sorted(SPM_FAMILIES))
def test_sentencepiece_from_gguf_equals_sentencepiece(tmp_path, arch):
    """Gemma 2 / Phi-3 SentencePiece: the GGUF-built tokenizer encodes as Google's
    encoder does, round-trips every text's bytes (<0xNN> for what no piece holds;
    Phi-3's dummy prefix space before a text), and still does once saved and read
    back from a directory."""
    sp = trained_sentencepiece(arch)
    sentencepiece_as_llamacpp_writes(sp, arch, tmp_path / "tok.gguf")
    tok = tokenizer_from_gguf(tmp_path / "tok.gguf")
    assert len(tok) == sp.get_piece_size()
    for text in TEXTS:
        assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text
    assert tok("hi")["input_ids"][0] == sp.bos_id()  # llama.cpp adds BOS here
    lead = b" " if SPM_FAMILIES[arch]["add_dummy_prefix"] else b""
    table = _round_trips(tok, SENTENCEPIECE, lead)
    assert table.byte_tokens().min() >= 0  # every byte has a token
    tok.save_pretrained(tmp_path / "dir")
    again = tokenizer_from_dir(tmp_path / "dir")
    for text in TEXTS:
        assert again(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text
    prompt = again.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == (f"{sp.id_to_piece(sp.bos_id())}<start_of_turn>user\nHi there<end_of_turn>\n"
                      "<start_of_turn>model\n")


def test_a_dummy_prefix_joins_union_ensembles_and_bytes(tmp_path):
    """Phi-3's SentencePiece puts a space before every text (from GGUF: a Prepend('▁')
    normalizer): it fuses across tokenizers (the member's ids spell its lead, the prompt
    and the text) and on bytes, as within its own vocabulary; a prefix step brf cannot
    remove is refused up front in one line."""
    from brf.align import make_codec, token_table
    from brf.bytes.state import ByteInputError
    from brf.ensemble import EnsembleInputError, generate
    from tests.byte_reference import tiny_model
    from tiny_lm import tiny_member, tiny_tokenizer
    from tokenizers import Tokenizer, normalizers
    sentencepiece_as_llamacpp_writes(trained_sentencepiece("phi3"), "phi3",
                                     tmp_path / "tok.gguf")
    tok = tokenizer_from_gguf(tmp_path / "tok.gguf")
    assert make_codec(tok).lead == b" "
    phi, other = tiny_member(0, tok, name="phi"), tiny_member(1, tiny_tokenizer(), name="b")
    got = generate([phi, other], ["the dog"], aligner="union", max_new_tokens=4,
                   sampler="greedy")[0]
    assert token_table(tok).decode(got.member_ids[0]) == b" the dog" + got.data
    cfg, params = tiny_model(len(tok))
    assert ByteLM(params, cfg, tok, name="phi").lead == b" "
    same = generate([phi, tiny_member(2, tok, name="phi2")], ["the dog"], max_new_tokens=2,
                    sampler="greedy")
    assert same[0].n_events == 2
    odd = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    odd.normalizer = normalizers.Sequence([normalizers.Prepend("▁▁"),
                                           normalizers.Replace(" ", "▁")])
    odd = TokenizersBackend(tokenizer_object=odd, eos_token="</s>", bos_token="<s>")
    weird = tiny_member(0, odd, name="odd")
    with pytest.raises(EnsembleInputError, match="member 0's tokenizer puts a space before "
                                                 "every text.*aligner='identity'"):
        generate([weird, other], ["the dog"], aligner="union", max_new_tokens=2)
    with pytest.raises(ByteInputError, match="odd's tokenizer puts a space"):
        ByteLM(params, cfg, odd, name="odd")


EXACT = dict(beam=10**6, threshold=0.0, max_lag=0, pad_to=16)


def _family_dir(tmp_path, cls, conf, tok):
    """A tiny random model of a family with `tok` saved beside it (its vocabulary
    padded past the tokenizer's, as real checkpoints pad theirs)."""
    torch.manual_seed(0)
    model = cls(conf).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3"])
def test_family_byte_view_equals_brute_force(tmp_path, family):
    """A Qwen2 with the BPE, a Gemma 2 and a Phi-3 with the SentencePiece tokenizer,
    read by registry.load from their directories: the byte-level prefix probabilities
    of short strings are the brute-force sums over their covers (float64); Phi-3's
    are conditioned on its dummy prefix, P(lead x) / P(lead)."""
    small = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64)
    if family == "qwen2":
        tok = trained_bpe()
        end = tok.convert_tokens_to_ids("<|endoftext|>")
        conf = transformers.Qwen2Config(**small, vocab_size=len(tok) + 5, bos_token_id=end,
                                        eos_token_id=tok.eos_token_id)
        path = _family_dir(tmp_path, transformers.Qwen2ForCausalLM, conf, tok)
        texts = ["ü d".encode()]  # a two-byte character, a space
    elif family == "gemma2":
        sp = trained_sentencepiece("gemma2")
        sentencepiece_as_llamacpp_writes(sp, "gemma2", tmp_path / "tok.gguf")
        tok = tokenizer_from_gguf(tmp_path / "tok.gguf")
        conf = transformers.Gemma2Config(**small, head_dim=8, vocab_size=len(tok) + 3,
                                         sliding_window=4, bos_token_id=2, eos_token_id=1,
                                         pad_token_id=0)
        path = _family_dir(tmp_path / "model", transformers.Gemma2ForCausalLM, conf, tok)
        texts = [" ı€".encode()]  # '€' only as <0xNN> byte tokens
    else:
        sp = trained_sentencepiece("phi3")
        sentencepiece_as_llamacpp_writes(sp, "phi3", tmp_path / "tok.gguf")
        tok = tokenizer_from_gguf(tmp_path / "tok.gguf")
        conf = transformers.Phi3Config(**small, vocab_size=len(tok) + 3, bos_token_id=2,
                                       eos_token_id=1, pad_token_id=0)
        path = _family_dir(tmp_path / "model", transformers.Phi3ForCausalLM, conf, tok)
        texts = ["Th€".encode(), b" d"]
    model = registry.load(path, cache=False, progress=False)
    assert model.cfg.arch == family and model.tokenizer is not None
    with jax.enable_x64(True):
        params = cast_params(model.params, jnp.float64)
        lm = ByteLM(params, model.cfg, model.tokenizer, name=family, dtype=jnp.float64)
        bf = BruteForce(params, model.cfg, lm.codec.table, lm.context(), dtype=jnp.float64)
        assert lm.lead == (b" " if family == "phi3" else b"")
        lead = bf.prefix_prob(lm.lead)[0] if lm.lead else 1.0
        for text in texts:
            r = score_text(lm, text, **EXACT)
            gold = r.logp[np.arange(len(text)), np.frombuffer(text, np.uint8)]
            P, _ = bf.prefix_prob(lm.lead + text)
            np.testing.assert_allclose(gold.sum(), np.log(P / lead), rtol=1e-6,
                                       err_msg=repr(text))
            assert r.stats["byte_ll"] >= r.stats["canonical_ll"] - 1e-9
