"""GGUF reader on tiny files written in the test with gguf.GGUFWriter.

The reference for the Q/K layout is a frozen copy of llama.cpp's
`LlamaModel.permute` (convert_hf_to_gguf.py): we start from HF-layout weights,
write what llama.cpp would write, and check the reader gives back the HF
weights transposed to [in, out].
"""

import os
import shutil

import gguf
import numpy as np
import pytest

from brf.checkpoints import gguf as G
from brf.models.transformer import param_shapes

Q = gguf.GGMLQuantizationType
V, D, L, H, K, E, F = 64, 64, 3, 4, 2, 16, 96


def llamacpp_permute(w_OxI, n_head, n_head_kv=None):
    """Frozen copy of convert_hf_to_gguf.py LlamaModel.permute (HF -> GGML rows)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w_OxI.reshape(n_head, 2, w_OxI.shape[0] // n_head // 2, *w_OxI.shape[1:])
            .swapaxes(1, 2).reshape(w_OxI.shape))


def hf_weights(arch, seed=0):
    """Random HF-layout weights ([out, in] like torch Linear), keyed by our param path."""
    rng = np.random.default_rng(seed)
    w = {"embed": rng.normal(size=(V, D)), "final_norm": 1 + 0.1 * rng.normal(size=D)}
    per_layer = {"attn_norm": (D,), "wq": (H * E, D), "wk": (K * E, D), "wv": (K * E, D),
                 "wo": (D, H * E), "mlp_norm": (D,), "w_gate": (F, D), "w_up": (F, D),
                 "w_down": (D, F)}
    if arch == "gemma3":
        per_layer.update(q_norm=(E,), k_norm=(E,), post_attn_norm=(D,), post_mlp_norm=(D,))
    for name, shape in per_layer.items():
        w[name] = [rng.normal(size=shape) * (0.1 if len(shape) == 2 else 1.0) for _ in range(L)]
    return {k: (np.asarray(v, np.float32) if not isinstance(v, list)
                else [np.asarray(x, np.float32) for x in v]) for k, v in w.items()}


GGUF_NAMES = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
    "wo": "attn_output", "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up",
    "w_down": "ffn_down", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
    "post_attn_norm": "post_attention_norm", "post_mlp_norm": "post_ffw_norm",
}
# One tensor type per parameter, so the test covers plain and block types.
TYPES = {"wq": Q.F32, "wk": Q.F16, "wv": Q.Q8_0, "wo": Q.BF16, "w_gate": Q.Q4_0,
         "w_up": Q.Q5_1, "w_down": Q.Q4_1, "embed": Q.Q8_0}


def quantized(x, qtype):
    """(bytes to write, the values a reader must return) for x stored as qtype."""
    if qtype == Q.F32:
        return x, x
    if qtype == Q.F16:
        return x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    q = gguf.quants.quantize(x, qtype)
    return q, gguf.quants.dequantize(q, qtype).reshape(x.shape)


def write_tiny(path, arch="llama", hf=None, extra_kv=None, extra_tensors=None,
               types=TYPES, skip=(), split_max_tensors=0):
    """Writes a tiny GGUF; returns {our path: expected array} (float32, our layout).
    With ``split_max_tensors``, as a split set of that many tensors a part (gguf's
    writer names and marks the parts as llama.cpp's gguf-split does)."""
    hf = hf or hf_weights(arch)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    kv = {f"{arch}.block_count": L, f"{arch}.context_length": 128,
          f"{arch}.embedding_length": D, f"{arch}.feed_forward_length": F,
          f"{arch}.attention.head_count": H, f"{arch}.attention.head_count_kv": K,
          f"{arch}.attention.key_length": E, f"{arch}.attention.value_length": E,
          f"{arch}.rope.freq_base": 10000.0 if arch == "llama" else 1e6,
          f"{arch}.attention.layer_norm_rms_epsilon": 1e-5}
    if arch == "gemma3":
        kv[f"{arch}.attention.sliding_window"] = 8
    kv.update(extra_kv or {})
    for key, value in kv.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    tokens = ["<|endoftext|>", "<s>", "</s>", "a", "b", "ab"] + [f"t{i}" for i in range(6, V)]
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    expected = {}

    def put(name, path, x, transform):
        qtype = types.get(path.split("/")[-1], Q.F32)
        data, back = quantized(x, qtype)
        if name not in skip:
            w.add_tensor(name, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
        return transform(back)

    expected["embed"] = put("token_embd.weight", "embed", hf["embed"], lambda x: x)
    expected["final_norm"] = put("output_norm.weight", "final_norm", hf["final_norm"],
                                 lambda x: x)
    # Write layers in reverse order: the reader must stack by index, not file order.
    for i in reversed(range(L)):
        for ours, gname in GGUF_NAMES.items():
            if ours not in hf:
                continue
            x = hf[ours][i]
            if arch == "llama" and ours in ("wq", "wk"):
                x = llamacpp_permute(x, H, H if ours == "wq" else K)
            back = put(f"blk.{i}.{gname}.weight", f"layers/{ours}", x, lambda x: x)
            if arch == "llama" and ours in ("wq", "wk"):
                # undo the permutation on the dequantized values to get the HF layout
                n = H if ours == "wq" else K
                back = back.reshape(n, E // 2, 2, D).swapaxes(1, 2).reshape(n * E, D)
            expected.setdefault(f"layers/{ours}", [None] * L)[i] = \
                back.T if back.ndim == 2 else back
    for name, arr in (extra_tensors or {}).items():
        arr, raw_dtype = arr if isinstance(arr, tuple) else (arr, None)
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: np.stack(v) if isinstance(v, list) else v for k, v in expected.items()}


def flat(params):
    out = {k: v for k, v in params.items() if k != "layers"}
    out.update({f"layers/{k}": v for k, v in params["layers"].items()})
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_roundtrip(tmp_path, arch):
    path = str(tmp_path / "tiny.gguf")
    expected = write_tiny(path, arch)
    cfg, params = G.load_gguf(path, progress=False)
    assert cfg.arch == arch and cfg.n_layers == L and cfg.head_dim == E
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size) == (H, K, F, V)
    # eos_ids: the file's EOS, then the tokens llama.cpp also ends generation on.
    assert cfg.tie_embeddings and cfg.bos_id == 1 and cfg.eos_ids == (2, 0)
    got = flat(params)
    assert set(got) == set(expected)
    for k, want in expected.items():
        np.testing.assert_array_equal(got[k], want, err_msg=k)
        assert got[k].dtype == np.float32
    shapes = param_shapes(cfg)
    assert got["layers/wq"].shape == shapes["layers"]["wq"]


def test_llama_qk_unpermute_recovers_hf_layout(tmp_path):
    """With F32 Q/K, the reader returns exactly HF's q_proj.T / k_proj.T."""
    hf = hf_weights("llama", seed=1)
    path = str(tmp_path / "t.gguf")
    write_tiny(path, "llama", hf=hf, types={})
    _, params = G.load_gguf(path, progress=False)
    for i in range(L):
        np.testing.assert_array_equal(params["layers"]["wq"][i], hf["wq"][i].T)
        np.testing.assert_array_equal(params["layers"]["wk"][i], hf["wk"][i].T)
        np.testing.assert_array_equal(params["layers"]["w_down"][i], hf["w_down"][i].T)


def test_quantized_values_close_to_original(tmp_path):
    hf = hf_weights("llama", seed=2)
    path = str(tmp_path / "t.gguf")
    write_tiny(path, "llama", hf=hf)
    _, params = G.load_gguf(path, progress=False)
    # Q8_0 keeps ~2 decimal digits of each 32-block's max; 4-bit types ~1.
    np.testing.assert_allclose(params["embed"], hf["embed"], atol=0.02)
    np.testing.assert_allclose(params["layers"]["wv"][0], hf["wv"][0].T, atol=0.005)
    np.testing.assert_allclose(params["layers"]["w_gate"][0], hf["w_gate"][0].T, atol=0.05)


def test_gemma3_config_and_norms(tmp_path):
    hf = hf_weights("gemma3", seed=3)
    path = str(tmp_path / "g.gguf")
    write_tiny(path, "gemma3", hf=hf, extra_kv={"gemma3.block_count": L})
    cfg, params = G.load_gguf(path, progress=False)
    assert cfg.layer_types == ("local",) * L  # pattern 6: layer 6 would be the first global
    assert cfg.sliding_window == 8 and cfg.rope_local_theta == 10000.0
    assert cfg.rope_theta == 1e6 and cfg.query_pre_attn_scalar == E
    assert cfg.act == "gelu_tanh" and cfg.embed_scale
    # Norm weights are kept as stored (llama.cpp stores the applied scale 1 + w).
    np.testing.assert_array_equal(params["layers"]["q_norm"][1], hf["q_norm"][1])
    np.testing.assert_array_equal(params["final_norm"], hf["final_norm"])
    # No RoPE permutation for gemma3.
    np.testing.assert_array_equal(params["layers"]["wq"][0],
                                  gguf.quants.dequantize(gguf.quants.quantize(
                                      hf["wq"][0], Q.F32), Q.F32).T)


def test_untied_lm_head(tmp_path):
    path = str(tmp_path / "t.gguf")
    head = np.random.default_rng(0).normal(size=(V, D)).astype(np.float32)
    write_tiny(path, extra_tensors={"output.weight": head})
    cfg, params = G.load_gguf(path, progress=False)
    assert not cfg.tie_embeddings
    np.testing.assert_array_equal(params["lm_head"], head)


def test_fast_header_parse_matches_gguf_reader(tmp_path):
    path = str(tmp_path / "t.gguf")
    write_tiny(path, extra_kv={"llama.rope.dimension_count": E})
    ours = G.open_gguf(path)
    ref = gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            want = field.contents()
            assert ours.metadata[key] == pytest.approx(want) if isinstance(want, float) \
                else ours.metadata[key] == want, key
    assert [(t.name, t.ggml_type, t.offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ref.tensors]


# ---------------------------------------------------------------------- refusals

def test_unknown_arch_refused(tmp_path):
    path = str(tmp_path / "f.gguf")
    write_tiny(path, "falcon")
    with pytest.raises(G.GGUFError, match="general.architecture.*falcon"):
        G.load_gguf(path, progress=False)


def test_unknown_metadata_field_refused(tmp_path):
    path = str(tmp_path / "t.gguf")
    write_tiny(path, extra_kv={"llama.expert_count": 8})
    with pytest.raises(G.GGUFError, match="llama.expert_count"):
        G.load_config(path)


@pytest.mark.parametrize("kv, match", [
    ({"llama.rope.scaling.type": "dynamic"}, "rope.scaling.type.*dynamic"),
    ({"llama.rope.scaling.type": "yarn"}, "rope.scaling.factor"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 32,
      "llama.rope.scaling.yarn_log_multiplier": 0.1}, "yarn_log_multiplier"),
    ({"llama.rope.scaling.type": "longrope"}, "rope_factors_long"),
])
def test_unsupported_rope_scaling_refused(tmp_path, kv, match):
    path = str(tmp_path / "t.gguf")
    write_tiny(path, extra_kv=kv)
    with pytest.raises(G.GGUFError, match=match):
        G.load_config(path)


def test_partial_rotary_refused(tmp_path):
    path = str(tmp_path / "t.gguf")
    write_tiny(path, extra_kv={"llama.rope.dimension_count": E // 2})
    with pytest.raises(G.GGUFError, match="rope.dimension_count"):
        G.load_config(path)


def test_unsupported_tensor_type_refused(tmp_path):
    path = str(tmp_path / "t.gguf")
    q2k = np.zeros(gguf.quants.quant_shape_to_byte_shape((F, 256), Q.Q2_K), np.uint8)
    write_tiny(path, skip=("blk.0.ffn_up.weight",),
               extra_tensors={"blk.0.ffn_up.weight": (q2k, Q.Q2_K)})
    with pytest.raises(G.GGUFError, match="blk.0.ffn_up.weight.*Q2_K.*not supported"):
        G.load_gguf(path, progress=False)


def test_unmapped_tensor_refused(tmp_path):
    path = str(tmp_path / "t.gguf")
    write_tiny(path, extra_tensors={"blk.0.attn_extra.weight": np.ones(E, np.float32)})
    with pytest.raises(G.GGUFError, match="blk.0.attn_extra.weight"):
        G.load_gguf(path, progress=False)


def test_missing_tensor_refused(tmp_path):
    path = str(tmp_path / "t.gguf")
    write_tiny(path, skip=("blk.1.attn_v.weight",))
    with pytest.raises(G.GGUFError, match="layers/wv"):
        G.load_gguf(path, progress=False)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999, 0.02])
def test_truncated_file_refused(tmp_path, keep):
    path = str(tmp_path / "t.gguf")
    write_tiny(path)
    data = open(path, "rb").read()
    cut = str(tmp_path / "cut.gguf")
    with open(cut, "wb") as f:
        f.write(data[:int(len(data) * keep)])
    with pytest.raises(G.GGUFError, match="truncated"):
        G.load_gguf(cut, progress=False)


def test_not_a_gguf_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(G.GGUFError, match="not a GGUF file"):
        G.open_gguf(str(path))
    with pytest.raises(FileNotFoundError):
        G.open_gguf(str(tmp_path / "missing.gguf"))


def test_corrupted_metadata_refused(tmp_path):
    """A string length field overwritten with garbage must not give a numpy traceback."""
    path = str(tmp_path / "t.gguf")
    write_tiny(path)
    data = bytearray(open(path, "rb").read())
    data[24:32] = (2**60).to_bytes(8, "little")  # first key's length
    bad = str(tmp_path / "bad.gguf")
    open(bad, "wb").write(bytes(data))
    with pytest.raises(G.GGUFError, match="truncated or corrupted"):
        G.open_gguf(bad)


def test_nonfinite_values_refused(tmp_path):
    path = str(tmp_path / "t.gguf")
    hf = hf_weights("llama")
    hf["final_norm"][3] = np.nan
    write_tiny(path, hf=hf)
    with pytest.raises(G.GGUFError, match="output_norm.weight.*non-finite"):
        G.load_gguf(path, progress=False)


# ---------------------------------------------------------------------- split files

def _split_set(tmp_path, name="t", **kw):
    """A tiny model as one file and as a split set of 3 parts (10 tensors a part):
    (the unsplit file, the parts in order)."""
    write_tiny(str(tmp_path / f"{name}-whole.gguf"), **kw)
    write_tiny(str(tmp_path / f"{name}.gguf"), split_max_tensors=10, **kw)
    parts = sorted(tmp_path.glob(f"{name}-0000?-of-00003.gguf"))
    assert len(parts) == 3
    return str(tmp_path / f"{name}-whole.gguf"), [str(p) for p in parts]


def test_split_set_reads_as_the_whole_file(tmp_path):
    """Whichever part is named, a split set reads as the unsplit file: the same
    config, parameters and logits; a registry source naming any part stands for
    the set (its first part)."""
    import jax

    from brf.checkpoints import registry
    from brf.models import prefill
    whole, parts = _split_set(tmp_path)
    assert "general.architecture" not in G._open_file(parts[1]).metadata
    want_cfg, want = G.load_gguf(whole, progress=False)
    tokens = np.arange(12, dtype=np.int32)[None] % V
    want_logits = np.asarray(prefill(jax.device_put(want), want_cfg, tokens, None, None)[0])
    for part in parts:
        f = G.open_gguf(part)
        assert f.path == parts[0] and len(f.data) == 3 and {t.part for t in f.tensors} == {0, 1, 2}
        cfg, params = G.load_gguf(part, progress=False)
        assert cfg == want_cfg
        for k, v in flat(want).items():
            np.testing.assert_array_equal(flat(params)[k], v, err_msg=k)
        np.testing.assert_array_equal(
            np.asarray(prefill(jax.device_put(params), cfg, tokens, None, None)[0]), want_logits)
        assert registry.resolve(part) == parts[0]
    assert G.split_parts(parts[2]) == parts and G.split_parts(whole) == [whole]


def test_split_set_missing_part_refused(tmp_path):
    _, parts = _split_set(tmp_path)
    os.remove(parts[1])
    for named in (parts[0], parts[2]):
        with pytest.raises(G.GGUFError, match=r"part 2 of 3 .* is missing: .*t-00002-of-00003"):
            G.load_gguf(named, progress=False)


def test_split_set_mismatched_part_refused(tmp_path):
    """A part of another set (another tensor count), or one under another part's number,
    is refused naming it; so is a part whose name does not say its set."""
    _, parts = _split_set(tmp_path)
    head = np.zeros((V, D), np.float32)
    _, other = _split_set(tmp_path, "u", extra_tensors={"output.weight": head})
    shutil.copy(other[2], parts[2])
    with pytest.raises(G.GGUFError, match=r"t-00003-of-00003.gguf does not belong .*"
                                          r"split.tensors.count are \(2, 3, 30\)"):
        G.load_gguf(parts[0], progress=False)
    shutil.copy(parts[0], parts[1])
    with pytest.raises(G.GGUFError, match=r"t-00002-of-00003.gguf does not belong"):
        G.load_gguf(parts[2], progress=False)
    renamed = str(tmp_path / "part.gguf")
    shutil.copy(other[0], renamed)
    with pytest.raises(G.GGUFError, match=r"split in 3 parts, but its name is not"):
        G.load_gguf(renamed, progress=False)


# ---------------------------------------------------------------------- real files

@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_file_configs(name):
    from brf.checkpoints import registry
    f = G.open_gguf(registry.resolve(name))
    cfg = G.config_from_file(f)
    if name.startswith("smollm2"):
        assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.vocab_size) == ("llama", 30, 576, 49152)
        assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta) == (9, 3, 64, 1e5)
        assert cfg.bos_id == 1 and cfg.eos_ids[0] == 2
    else:
        assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.vocab_size) == \
            ("gemma3", 18, 640, 262144)
        assert cfg.layer_types.count("global") == 3 and cfg.layer_types[5] == "global"
        assert cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
        assert cfg.bos_id == 2 and cfg.eos_ids == (1, 106)
    types = {t.ggml_type.name for t in f.tensors}
    assert types <= {t.name for t in G.SUPPORTED_TYPES}

