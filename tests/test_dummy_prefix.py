"""Members whose SentencePiece puts a space before every text (Llama 2, Mistral 7B, Phi-3),
across vocabularies, on the real tokenizer files mistral-common ships.

mistral-common (a test extra, installed without its dependencies: only its data files
are read) ships Mistral AI's SentencePiece models: ``tokenizer.model.v1`` is Mistral 7B
v0.1's (the Llama 2 shape: 32000 BPE pieces, byte fallback, a dummy prefix) and
``mistral_instruct_tokenizer_240323.model.v3`` is v0.3's (32768 pieces, ``[INST]`` /
``[/INST]`` control tokens). Each is read three ways: transformers' own conversion of
the file (a ``Metaspace`` pre-tokenizer), the shape of the tokenizer.json Llama 2's and
Mistral 7B's Hugging Face repositories publish (a ``Prepend('▁')`` normalizer; rebuilt
here from the conversion, since no package ships that file), and a GGUF written as
llama.cpp writes it, read by `brf.checkpoints.tokenizer`. Checked:

* brf's ids (its mid-text encoder after the lead) are transformers' fast tokenizer's
  ids for every text, and sentencepiece's own where the two agree;
* re-encoding a generation chunk by chunk (byte fallback halves of a character, the
  '▁' character itself, newlines, runs of spaces) keeps the ids spelling the lead, the
  prompt and the bytes, and ends on the tokenizer's own ids for the whole string (an
  empty prompt, and a chat prompt ending in v0.3's ``[/INST]``, included);
* the byte-level view of a tiny random model over the real vocabulary is P(x | lead) =
  P(lead x) / P(lead) by brute force over every tokenization (float64, exact mode);
* union and top-k ensembles, byte-level generation and speculative decoding run with
  such a member and a byte-level BPE member.
"""

import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from brf.align import token_table  # noqa: E402
from brf.bytes.generate import generate_bytes  # noqa: E402
from brf.bytes.lm import ByteLM, score_text  # noqa: E402
from brf.checkpoints.tokenizer import tokenizer_from_gguf  # noqa: E402
from brf.ensemble import generate  # noqa: E402
from brf.models import cast_params  # noqa: E402
from tests.byte_reference import BruteForce, tiny_model  # noqa: E402
from tiny_lm import tiny_member, tiny_tokenizer  # noqa: E402

R = sys.modules["brf.align.reencode"]  # the module (brf.align.reencode is the function)

V1, V3 = "tokenizer.model.v1", "mistral_instruct_tokenizer_240323.model.v3"
SHAPES = ("metaspace", "prepend", "gguf")
TEXTS = ["The quick brown fox.", "Hello", "x\ny", "\n\nfoo bar", "a\tb", "2024: 3.14159",
         "Emoji 🙂 and 東京", "ünïcödé ½", "a▁b", "  two leading spaces", " one", "tab\t\tend  ",
         "def f(x):\n    return x", "\x00\x07"]


def real_file(name: str) -> str:
    """A SentencePiece model shipped in mistral-common's wheel (skip when absent)."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mistral-common (a test extra: bash install.sh --test) is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", name)
    if not os.path.exists(path):
        pytest.skip(f"mistral-common has no {name}")
    return path


_TOKS: dict = {}


def real_tokenizer(name: str, shape: str, tmp_dir):
    """The fast tokenizer of a real file, read in one of SHAPES (built once per module)."""
    key = (name, shape)
    if key in _TOKS:
        return _TOKS[key]
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    d = tmp_dir / f"{name}-{shape}"
    d.mkdir()
    shutil.copy(real_file(name), d / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(str(d))
    if shape == "prepend":  # Llama 2's / Mistral 7B's published tokenizer.json
        from tokenizers import Tokenizer
        spec = json.loads(tok.backend_tokenizer.to_str())
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        spec["pre_tokenizer"] = None
        tok = TokenizersBackend(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                add_bos_token=True)
    elif shape == "gguf":  # as llama.cpp's converter writes it, read by brf
        import sentencepiece as spm
        from tests.test_family_tokenizers import sentencepiece_as_llamacpp_writes
        sp = spm.SentencePieceProcessor(model_file=real_file(name))
        sentencepiece_as_llamacpp_writes(sp, "llama", d / "tok.gguf")
        tok = tokenizer_from_gguf(d / "tok.gguf")
    _TOKS[key] = tok
    return tok


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("real_spm")


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("shape", SHAPES)
def test_real_file_ids_are_the_fast_tokenizers(tmp_dir, shape):
    """brf's codec finds the lead, and its mid-text encoder gives transformers' ids for
    every text (the tokenizer spells lead + text; a Metaspace one skips the lead before
    a text that starts with a space, which brf then reads as that text's own space),
    and sentencepiece's ids where transformers' agree with them."""
    import sentencepiece as spm
    tok = real_tokenizer(V1, shape, tmp_dir)
    sp = spm.SentencePieceProcessor(model_file=real_file(V1))
    codec = R.make_codec(tok)
    assert codec.lead == b" " and codec.mid is not None
    R.check_reencodable(codec)
    metaspace = json.loads(tok.backend_tokenizer.to_str())["normalizer"] is None
    agree = 0
    for text in TEXTS:
        want = _ids(tok, text)
        spelled = codec.table.decode(want)
        lead = b"" if metaspace and text.startswith(" ") else b" "
        assert spelled == lead + text.replace("▁", " ").encode(), (shape, text)
        if "▁" not in text:
            assert R.encode_bytes(codec, spelled) == want, (shape, text)
            assert R.start(codec, text[len(lead) == 0:].encode()).ids == tuple(want)
        if "  " not in " " + text and "▁" not in text:  # transformers merges across spaces
            assert sp.encode(text) == want, (shape, text)
            agree += 1
    assert agree >= 8
    # the '▁' character itself: byte fallback, as nothing else spells it
    assert codec.table.decode(R.encode_bytes(codec, " a▁b".encode())) == " a▁b".encode()


def _chunks(data: bytes, rng) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, 4)
        out.append(data[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_re_encoding_keeps_the_lead_and_the_tokenizers_ids(tmp_dir, shape):
    """Generated bytes arriving in chunks of 1-4 bytes (characters cut in half): after
    every chunk the member's ids spell its text (lead, prompt, bytes); at the end they
    are the tokenizer's ids for the whole string, from a prompt with text, an empty one
    (the lead still to come) and, in v0.3's vocabulary, a chat prompt ending in the
    control token [/INST]."""
    rng = random.Random(0)
    tok = real_tokenizer(V1, shape, tmp_dir)
    codec = R.make_codec(tok)
    bos = [tok.convert_tokens_to_ids("<s>")]
    metaspace = json.loads(tok.backend_tokenizer.to_str())["normalizer"] is None
    for prompt, gen in [("The dog", " sat on the mat.\n\nIt was 🙂 東京 a▁b  ok"),
                        ("", "Hello  world\n  indented ½"), ("x", "y\n\n\tz")]:
        state = R.from_ids(codec, bos + _ids(tok, prompt))
        if not prompt:
            assert state.text == b" " and state.ids == tuple(bos)
        for piece in _chunks(gen.encode(), rng):
            step = R.reencode(codec, state, piece)
            state = step.state
            assert codec.table.decode(state.ids) == state.text
        assert state.text == b" " + (prompt + gen).encode()
        if "▁" not in gen and not (metaspace and (prompt + gen).startswith(" ")):
            assert list(state.ids) == bos + _ids(tok, prompt + gen), (shape, prompt)
    if shape != "metaspace":
        return
    tok3 = real_tokenizer(V3, "metaspace", tmp_dir)
    c3 = R.make_codec(tok3)
    ids = [tok3.convert_tokens_to_ids("<s>")] + _ids(tok3, "[INST] Hi[/INST]")
    assert ids[-1] == tok3.convert_tokens_to_ids("[/INST]")
    state = R.from_ids(c3, ids)
    assert state.floor == len(ids) and state.text == b" Hi" + c3.control_lead
    for piece in _chunks(b"Hello there, friend", rng):
        state = R.reencode(c3, state, piece).state
    assert list(state.ids[1:]) == _ids(tok3, "[INST] Hi[/INST]Hello there, friend")


EXACT = dict(beam=10**6, threshold=0.0, max_lag=0, pad_to=16)


def test_byte_view_is_conditioned_on_the_lead(tmp_dir):
    """A tiny random model over Mistral 7B's real vocabulary: score_text's prefix
    probability of short strings is P(lead x) / P(lead), both by brute force over
    every tokenization (float64); after a context that ends in text, no lead."""
    tok = real_tokenizer(V1, "prepend", tmp_dir)
    with jax.enable_x64(True):
        cfg, params = tiny_model(len(tok), seed=3, dtype=jnp.float64, sharpness=6.0)
        lm = ByteLM(params, cfg, tok, name="mistral", dtype=jnp.float64)
        assert lm.lead == b" "
        bf = BruteForce(params, cfg, lm.codec.table, lm.context(), dtype=jnp.float64)
        lead, _ = bf.prefix_prob(b" ")
        for text in [b"Hi", b" a", b"\n1", "é".encode()]:
            r = score_text(lm, text, **EXACT)
            gold = r.logp[np.arange(len(text)), np.frombuffer(text, np.uint8)]
            P, _ = bf.prefix_prob(b" " + text)
            np.testing.assert_allclose(gold.sum(), np.log(P / lead), rtol=1e-7,
                                       err_msg=repr(text))
            np.testing.assert_allclose(r.stats["lead_ll"], np.log(lead), rtol=1e-7)
            assert r.stats["byte_ll"] >= r.stats["canonical_ll"] - 1e-9
        ctx = [1] + _ids(tok, "Hi")
        assert lm.lead_after(ctx) == b"" and lm.lead_after([1]) == b" "
        bf2 = BruteForce(params, cfg, lm.codec.table, ctx, dtype=jnp.float64)
        r = score_text(lm, b"s!", context_ids=ctx, **EXACT)
        P, _ = bf2.prefix_prob(b"s!")
        np.testing.assert_allclose(r.logp[[0, 1], [ord("s"), ord("!")]].sum(), np.log(P),
                                   rtol=1e-7)


def _members(tok):
    return [tiny_member(0, tok, name="mistral"), tiny_member(1, tiny_tokenizer(), name="bpe")]


@pytest.mark.parametrize("aligner", ["union", "topk_union"])
def test_token_level_ensembles_spell_the_lead_and_the_text(tmp_dir, aligner):
    """Union and top-k union generation with a Mistral-vocabulary member: the device and
    host engines agree, and the member's final ids decode to its lead, the prompt and the
    generated bytes. (A prompt with the lead still to come, after BOS alone or a chat
    template's last control token, is checked on the codec below and at the byte level:
    generate refuses an empty prompt, brf's one prompt rule.)"""
    tok = real_tokenizer(V1, "prepend", tmp_dir)
    members = _members(tok)
    kw = dict(aligner=aligner, max_new_tokens=6, sampler="greedy")
    dev = generate(members, ["the dog"], engine="device", **kw)[0]
    host = generate(members, ["the dog"], engine="host", **kw)[0]
    assert dev.data == host.data and len(host.data) > 0
    table = token_table(tok)
    assert table.decode(host.member_ids[0]) == b" the dog" + host.data
    if aligner == "union":
        mix = generate(members, ["the dog"], aligner="union", mode="mixture_exact", seed=1,
                       max_new_tokens=6, engine="host")[0]
        assert table.decode(mix.member_ids[0]) == b" the dog" + mix.data


def test_byte_level_generation_reads_the_lead(tmp_dir):
    """Byte-level generation and speculative decoding with a Mistral-vocabulary member:
    after a prompt with text the bytes go on in place; after BOS alone the member reads
    its lead first (its first distribution is P(. | lead)), and its ids spell lead +
    text; exact mode agrees with score_text's conditioned rows."""
    from brf.bytes.speculative import generate_bytes_speculative
    tok = real_tokenizer(V1, "prepend", tmp_dir)
    a, b = _members(tok)
    with jax.enable_x64(True):
        lms = [ByteLM(cast_params(m.params, jnp.float64), m.cfg, m.tokenizer, name=m.name,
                      dtype=jnp.float64) for m in (a, b)]
        table = lms[0].codec.table
        for prompt in ["the dog", ""]:
            ctxs = [m.prompt_ids(prompt) for m in (a, b)]
            g = generate_bytes(lms, ctxs, max_bytes=5, sampler="greedy", beam=10**6,
                               threshold=0.0, trace=True)
            assert len(g.data) > 0
            ids = g.member_ids[0]
            lead = lms[0].lead_after(ctxs[0])
            assert lead == (b"" if prompt else b" ")
            if ids is not None:
                assert table.decode(ids) == lead + g.data
            ref = score_text(lms[0], g.data, context_ids=ctxs[0], **EXACT)
            rows = np.stack([t["member_logp"][0] for t in g.trace[:len(g.data)]])
            np.testing.assert_allclose(rows, ref.logp, atol=1e-9)
            s = generate_bytes_speculative(lms, ctxs, drafter="ngram", max_bytes=5,
                                           sampler="greedy", beam=10**6, threshold=0.0)
            assert s.data == g.data


def test_gemma_style_sentencepiece_is_unchanged(tmp_dir):
    """Without a dummy prefix the codec's mid-text encoder is the tokenizer itself."""
    from tests.test_family_tokenizers import (sentencepiece_as_llamacpp_writes,
                                              trained_sentencepiece)
    sentencepiece_as_llamacpp_writes(trained_sentencepiece("gemma2"), "gemma2",
                                     tmp_dir / "gemma.gguf")
    tok = tokenizer_from_gguf(tmp_dir / "gemma.gguf")
    codec = R.make_codec(tok)
    assert codec.lead == b"" and codec.mid is tok.backend_tokenizer
    assert R.lead_after(codec, [2]) == b""
    st = R.from_ids(codec, [2] + _ids(tok, "the dog"))
    assert st.text == b"the dog"


def test_refused_before_converting(tmp_path, monkeypatch):
    """A member brf cannot fuse across vocabularies (here a prefix step it does not
    know) is refused by configs/generate.py's run, in one line naming it, before its
    model is converted into the cache; alone or with its own vocabulary it is not."""
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer, normalizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    from brf.checkpoints import registry
    from brf.ensemble.member import EnsembleInputError
    from brf.ensemble.run import check_fusable, run
    from test_ensemble import _generate_config_module
    monkeypatch.setenv("BRF_CACHE", str(tmp_path / "cache"))
    tok = real_tokenizer(V1, "prepend", tmp_path)
    odd = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    odd.normalizer = normalizers.Sequence([normalizers.Prepend("▁▁"),
                                           normalizers.Replace(" ", "▁")])
    odd = TokenizersBackend(tokenizer_object=odd, bos_token="<s>", eos_token="</s>")
    dirs = []
    for name, t in [("odd", odd), ("fine", tiny_tokenizer())]:
        torch.manual_seed(0)
        conf = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        num_hidden_layers=1, vocab_size=len(t),
                                        max_position_embeddings=64)
        transformers.LlamaForCausalLM(conf).save_pretrained(tmp_path / name)
        t.save_pretrained(tmp_path / name)
        dirs.append(str(tmp_path / name))
    c = _generate_config_module().get_config("tiny")
    c.members = f'{dirs[0]}(name="odd"), random:{dirs[1]}'
    c.prompts = ("the cat",)
    c.max_new_tokens = 2
    with pytest.raises(EnsembleInputError, match="cannot be fused across vocabularies.*"
                                                 "Prepend.*before converting"):
        run(c)
    assert not registry.converted(dirs[0])
    assert not os.path.exists(tmp_path / "cache" / "checkpoints")
    check_fusable([dict(model=dirs[0])], aligner="auto")  # alone: its own vocabulary
    check_fusable([dict(model=dirs[1]), dict(model="random:" + dirs[0])], aligner="identity")
    check_fusable([dict(model=dirs[1]), dict(model=f"random:{dirs[1]}:1")], level="bytes")
    with pytest.raises(EnsembleInputError, match="'.*odd'.*cannot be fused"):
        check_fusable([dict(model=dirs[0])], level="bytes")
    # the study (experiments/validate.py): the same refusal in one line, exit 2, before
    # either model is converted; scoring fixed text on co-aligned tokens needs no
    # re-encoding, so without the byte level the same members pass the check
    env = {**os.environ, "BRF_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "experiments/validate.py",
                          "--config=configs/validate.py:short", "--config.bytes.enabled=True",
                          f"--config.members={dirs[0]}, {dirs[1]}",
                          f"--config.out_dir={tmp_path / 'study'}"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr[-2000:]
    assert re.search(r"odd'.*cannot be fused across vocabularies.*before converting", err[0])
    assert not os.path.exists(tmp_path / "cache" / "checkpoints")
    check_fusable([dict(model=d) for d in dirs], reencode=False)
    if importlib.util.find_spec("lm_eval"):  # the harness model (the test extra has it)
        from brf.harness.lm import BRFLM
        with pytest.raises(EnsembleInputError, match="odd'.*before converting"):
            BRFLM(f"{dirs[0]}, {dirs[1]}", level="bytes")
        assert not os.path.exists(tmp_path / "cache" / "checkpoints")
