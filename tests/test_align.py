"""brf.align: byte tables, union event space, aligners, stable re-encoding.

Toy vocabularies (a byte-level BPE and a SentencePiece-style BPE with byte
fallback, built with `tokenizers`) check every rule against float64 NumPy
references written with plain loops over token strings; the two real
tokenizers (SmolLM2 byte-level BPE, Gemma 3 SentencePiece) check sizes, known
strings, normalisation and round-trip re-encoding.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

import brf
from brf import align as A
from brf.align import aligners as AL

# ----------------------------------------------------------------------------- toys

B2U = A.bytes_to_unicode()


def toy_byte_level() -> Tokenizer:
    """All 256 byte characters, a few merges (' the', ' theory', 'é', '\\n\\n'), 2 specials."""
    vocab = {B2U[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("o", "r"), ("or", "y"), ("Ġthe", "ory"),
              ("Ã", "©"), ("Ċ", "Ċ"), ("a", "b")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True),
                            AddedToken("<|im_end|>", special=True)])
    return tok


def toy_sentencepiece() -> Tokenizer:
    """<unk>/<s>/</s>, 256 <0xNN> bytes, '▁', a few letters and merges, 'é', '\\n'."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "t", "h", "e", "o", "r", "y", "a", "b", "é", "\n"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("o", "r"), ("or", "y"), ("▁the", "ory"),
              ("a", "b"), ("▁", "▁")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tok


@pytest.fixture(scope="module")
def toys():
    toks = [toy_byte_level(), toy_sentencepiece()]
    return toks, [A.token_table(t) for t in toks]


def _pieces(tok: Tokenizer) -> list[str]:
    vocab = tok.get_vocab(with_added_tokens=True)
    out = [""] * len(vocab)
    for p, i in vocab.items():
        out[i] = p
    return out


def ref_bytes(tok: Tokenizer, kind: str) -> tuple[list[bytes], list[bool]]:
    """Independent reading of token bytes: GPT-2 map built from its definition / '<0xNN>'."""
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    others = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable}
    char_to_byte.update({chr(256 + j): b for j, b in enumerate(others)})
    out = []
    for i, p in enumerate(_pieces(tok)):
        if i in special:
            out.append(b"")
        elif kind == A.BYTE_LEVEL:
            out.append(bytes(char_to_byte[c] for c in p))
        elif p.startswith("<0x") and p.endswith(">") and len(p) == 6:
            out.append(bytes([int(p[3:5], 16)]))
        else:
            out.append(p.replace("▁", " ").encode())
    return out, [i in special for i in range(len(out))]


def ref_union_probs(tables_bytes, controls, logits_list):
    """float64: member token probs summed per byte string; control pooled under key None."""
    events = sorted({b for tb, cs in zip(tables_bytes, controls) for b, c in zip(tb, cs)
                     if not c and b})
    out = []
    for tb, cs, logits in zip(tables_bytes, controls, logits_list):
        x = np.asarray(logits, np.float64)
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        d = {None: np.zeros(x.shape[:-1])} | {e: np.zeros(x.shape[:-1]) for e in events}
        for t, (b, c) in enumerate(zip(tb, cs)):
            d[None if (c or not b) else b] += p[..., t]
        out.append(d)
    return [None] + events, out


# ----------------------------------------------------------------------------- byte tables

def test_bytes_to_unicode_is_gpt2():
    assert len(B2U) == 256 and len(set(B2U.values())) == 256
    assert B2U[0x20] == "Ġ" and B2U[0x0A] == "Ċ" and B2U[ord("a")] == "a"
    assert B2U[0xE2] == "â" and B2U[0x00] == "Ā"


@pytest.mark.parametrize("which,kind", [(0, A.BYTE_LEVEL), (1, A.SENTENCEPIECE)])
def test_token_table_matches_reference(toys, which, kind):
    toks, tables = toys
    t = tables[which]
    assert t.kind == kind == A.decoder_kind(toks[which])
    ref, ctl = ref_bytes(toks[which], kind)
    assert list(t.token_bytes) == ref
    assert t.control_V.tolist() == ctl
    # every single byte has a token; tokenizer.decode agrees on valid UTF-8 tokens
    assert (t.byte_tokens() >= 0).all()
    for i, b in enumerate(t.token_bytes):
        if b and not t.control_V[i]:
            try:
                s = b.decode()
            except UnicodeDecodeError:
                continue
            assert toks[which].decode([i], skip_special_tokens=False) == s, (i, b)


def test_token_table_known_pieces(toys):
    toks, (bl, sp) = toys
    v_bl, v_sp = toks[0].get_vocab(), toks[1].get_vocab()
    assert bl.token_bytes[v_bl["Ġthe"]] == b" the"
    assert bl.token_bytes[v_bl["Ċ"]] == b"\n"
    assert bl.token_bytes[v_bl["Ã©"]] == "é".encode()
    assert bl.token_bytes[v_bl["â"]] == b"\xe2"
    assert sp.token_bytes[v_sp["▁the"]] == b" the"
    assert sp.token_bytes[v_sp["<0xE2>"]] == b"\xe2"
    assert sp.token_bytes[v_sp["<0x61>"]] == sp.token_bytes[v_sp["a"]] == b"a"
    assert sp.control_V[v_sp["</s>"]] and sp.token_bytes[v_sp["</s>"]] == b""
    assert bl.control_V[v_bl["<|im_end|>"]]
    assert bl.digest != sp.digest and A.token_table(toks[0]).digest == bl.digest


def test_unknown_decoder_is_refused():
    tok = Tokenizer(models.BPE({"a": 0}, []))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="unsupported tokenizer decoder"):
        A.token_table(tok)


# ----------------------------------------------------------------------------- union table

def test_union_table_matches_reference(toys):
    toks, tables = toys
    u = A.build_union(tables)
    refs = [ref_bytes(t, tb.kind) for t, tb in zip(toks, tables)]
    events = sorted({b for tb, cs in refs for b, c in zip(tb, cs) if not c and b})
    assert u.strings == (b"",) + tuple(events)
    for (tb, cs), ix, has in zip(refs, u.index, u.has_nU):
        for t, (b, c) in enumerate(zip(tb, cs)):
            assert ix[t] == (A.CONTROL if c else 1 + events.index(b))
        assert set(np.flatnonzero(has)) == set(ix.tolist())
    # member order does not change event ids; only the per-member rows swap
    v = A.build_union(tables[::-1])
    assert v.strings == u.strings and (v.anchor_nU == u.anchor_nU[::-1]).all()
    s = u.stats()
    assert s["events"] == len(events) + 1
    shared = set(tb for tb, c in zip(*refs[0]) if not c) & set(tb for tb, c in zip(*refs[1])
                                                               if not c)
    assert s["shared_by_all"] == len(shared)
    assert u.event_id(b" the") == 1 + events.index(b" the")
    al = A.make_aligner("union", tables)
    assert al.event_bytes(u.event_id(b" the")) == b" the" and al.is_control(A.CONTROL)
    with pytest.raises(KeyError):
        u.event_id(b"not a token")


def test_anchors_are_longest_proper_prefix(toys):
    _, tables = toys
    u = A.build_union(tables)
    for i, t in enumerate(tables):
        mine = {b for b, c in zip(t.token_bytes, t.control_V) if not c and b}
        for e, s in enumerate(u.strings):
            if e == A.CONTROL:
                assert u.anchor_nU[i, e] == (e if t.control_V.any() else -1)
            elif s in mine:
                assert u.anchor_nU[i, e] == e
            else:
                prefixes = [s[:n] for n in range(1, len(s)) if s[:n] in mine]
                want = u.event_id(max(prefixes, key=len)) if prefixes else -1
                assert u.anchor_nU[i, e] == want, (i, s)
    # a concrete case: ' theory' has a token in both toys; 'ab' too; ' ab' in neither
    assert u.anchor_nU[1, u.event_id(b"\n\n")] == u.event_id(b"\n")


def test_union_cache_memory_and_disk(toys, tmp_path):
    _, tables = toys
    A.clear_memory_cache()
    t1 = A.union_table(tables, tmp_path)
    assert A.union_table(tables, tmp_path) is t1
    files = list(tmp_path.glob("union-*.npz"))
    assert [f.name for f in files] == [f"union-{A.table_key(tables)}.npz"]
    A.clear_memory_cache()
    t2 = A.union_table(tables, tmp_path)
    assert t2 is not t1 and t2.strings == t1.strings and t2.digests == t1.digests
    for a, b in zip(t1.index, t2.index):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(t1.anchor_nU, t2.anchor_nU)
    np.testing.assert_array_equal(t1.has_nU, t2.has_nU)
    A.clear_memory_cache()


# ----------------------------------------------------------------------------- aligners

def test_registry():
    assert A.ALIGNERS.names() == ["identity", "topk_union", "union"]
    with pytest.raises(KeyError, match="known: identity"):
        A.ALIGNERS.get("nope")


def test_segment_logsumexp_no_underflow():
    x = np.array([[-200.0, -201.0, -0.5, -300.0, -1e9]])
    ix = np.array([0, 0, 1, 2, 2])
    got = np.asarray(A.segment_logsumexp(jnp.asarray(x, jnp.float32), jnp.asarray(ix), 4))
    want = [np.logaddexp(-200.0, -201.0), -0.5, np.logaddexp(-300.0, -1e9), -np.inf]
    np.testing.assert_allclose(got[0], want, rtol=1e-6)


def _random_logits(rng, tables, shape=(3,), scale=4.0):
    out = []
    for t in tables:
        x = rng.normal(size=shape + (t.size,)) * scale
        out.append(x)
    return out


def test_union_aligner_matches_reference(toys):
    toks, tables = toys
    rng = np.random.default_rng(0)
    logits = _random_logits(rng, tables)
    # a strong duplicate: SentencePiece 'a' and '<0x61>' both likely
    v = toks[1].get_vocab()
    logits[1][..., v["a"]] += 6
    logits[1][..., v["<0x61>"]] += 6
    al = A.make_aligner("union", tables)
    got = al([jnp.asarray(x, jnp.float32) for x in logits])
    refs = [ref_bytes(t, tb.kind) for t, tb in zip(toks, tables)]
    keys, ref = ref_union_probs([r[0] for r in refs], [r[1] for r in refs], logits)
    p = np.exp(np.asarray(got.logp_XnE, np.float64))
    assert p.shape == (3, 2, len(keys))
    for i in range(2):
        want = np.stack([ref[i][k] for k in keys], -1)
        np.testing.assert_allclose(p[:, i], want, atol=2e-6, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(got.info["control_mass_Xn"])[:, i], ref[i][None],
                                   rtol=1e-5)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    # duplicates summed, not lost
    e = al.union.event_id(b"a")
    x = logits[1] - logits[1].max(-1, keepdims=True)
    pa = (np.exp(x[..., v["a"]]) + np.exp(x[..., v["<0x61>"]])) / np.exp(x).sum(-1)
    np.testing.assert_allclose(p[:, 1, e], pa, rtol=1e-5)
    # strings a member lacks: -inf for it
    lack = ~al.union.has_nU
    assert np.isneginf(np.asarray(got.logp_XnE)[:, lack]).all()


def ref_topk(tables, union, logits, k):
    """Reference top-k union with plain loops: returns {event: prob} per row and member, kept."""
    keys = union.strings
    probs = []
    for t, x in zip(tables, logits):
        x = np.asarray(x, np.float64)
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        pe = np.zeros(x.shape[:-1] + (len(keys),))
        pos = {s: e for e, s in enumerate(keys)}
        for tid, (b, c) in enumerate(zip(t.token_bytes, t.control_V)):
            pe[..., 0 if (c or not b) else pos[b]] += p[..., tid]
        probs.append(pe)
    rows, kept = [], []
    for r in range(logits[0].shape[0]):
        K = []
        for pe in probs:
            for e in np.argsort(-pe[r], kind="stable")[:k]:
                if e not in K:
                    K.append(int(e))
        row, krow = [], []
        for i, (t, pe) in enumerate(zip(tables, probs)):
            mine = {b for b, c in zip(t.token_bytes, t.control_V) if not c and b}
            has_ctl = bool(t.control_V.any())

            def anchor(e):
                s = keys[e]
                if e == 0:
                    return 0 if has_ctl else None
                if s in mine:
                    return e
                pre = [s[:n] for n in range(len(s) - 1, 0, -1) if s[:n] in mine]
                return pos_of(pre[0]) if pre else None

            pos_of = {s: e for e, s in enumerate(keys)}.__getitem__
            anchors = {e: anchor(e) for e in K}
            q = {}
            for e in K:
                a = anchors[e]
                q[e] = 0.0 if a is None else pe[r, a] / sum(1 for f in K if anchors[f] == a)
            total = sum(q.values())
            krow.append(total)
            row.append({e: v / total for e, v in q.items()})
        rows.append(row)
        kept.append(krow)
    return rows, np.asarray(kept)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_union_matches_reference(toys, k):
    _, tables = toys
    rng = np.random.default_rng(k)
    logits = _random_logits(rng, tables, shape=(4,), scale=2.0)
    al = A.make_aligner("topk_union", tables)
    got = al([jnp.asarray(x, jnp.float32) for x in logits], k=k)
    rows, kept = ref_topk(tables, al.union, logits, k)
    lp = np.asarray(got.logp_XnE, np.float64)
    ev = np.asarray(got.events_XE)
    assert lp.shape == (4, 2, 2 * k) and ev.shape == (4, 2 * k)
    np.testing.assert_allclose(np.asarray(got.info["kept_Xn"]), kept, rtol=1e-5)
    for r in range(4):
        valid = ev[r] >= 0
        assert sorted(ev[r][valid].tolist()) == sorted(rows[r][0])
        assert np.isneginf(lp[r][:, ~valid]).all()
        for i in range(2):
            got_i = {int(e): float(np.exp(v)) for e, v in zip(ev[r][valid], lp[r, i][valid])}
            for e, want in rows[r][i].items():
                assert abs(got_i[e] - want) < 1e-5, (r, i, e)
            assert abs(np.exp(lp[r, i]).sum() - 1.0) < 1e-5


def test_topk_union_shares_prefix_mass(toys):
    """' theory' lacked by a member is scored from its ' the' token, shared evenly."""
    toks, tables = toys
    u = A.build_union(tables)
    # member 0 lacks nothing here; build a member without ' theory' and 'ory'
    the, theory = u.event_id(b" the"), u.event_id(b" theory")
    n_events = u.size
    logp_U = np.full((2, n_events), -50.0)
    logp_U[0, theory], logp_U[0, the] = np.log(0.6), np.log(0.3)
    logp_U[1, the] = np.log(0.9)
    anchor = np.tile(np.arange(n_events, dtype=np.int32), (2, 1))
    anchor[1, theory] = the  # member 1 has no ' theory' token
    logp_U = logp_U - jax.nn.logsumexp(logp_U, -1, keepdims=True)
    out, ev, kept = AL.topk_union_logprobs(jnp.asarray(logp_U, jnp.float32),
                                           jnp.asarray(anchor), k=2)
    p = dict(zip(np.asarray(ev).tolist(), np.exp(np.asarray(out[1])).tolist()))
    assert p[the] == pytest.approx(p[theory])  # member 1's ' the' mass split over both
    assert float(kept[1]) == pytest.approx(float(np.exp(logp_U[1, the])
                                                 + np.exp(logp_U[1, ev[3]])), rel=1e-4)


def test_identity_exact_and_refuses_mixed(toys):
    toks, tables = toys
    rng = np.random.default_rng(3)
    x = [jnp.asarray(v, jnp.float32) for v in _random_logits(rng, [tables[1]] * 3, (2, 5))]
    al = A.make_aligner("identity", [tables[1]] * 3)
    got = al(x)
    np.testing.assert_array_equal(np.asarray(got.logp_XnE),
                                  np.asarray(jax.nn.log_softmax(jnp.stack(x, -2), -1)))
    assert got.logp_XnE.shape == (2, 5, 3, tables[1].size)
    v = toks[1].get_vocab()
    assert al.event_bytes(v["▁the"]) == b" the" and al.is_control(v["</s>"])
    with pytest.raises(ValueError, match="one vocabulary"):
        A.make_aligner("identity", tables)
    with pytest.raises(ValueError, match="no parameter"):
        al(x, k=3)


def test_union_jit_no_retrace_and_fuse(toys):
    _, tables = toys
    al = A.make_aligner("union", tables)
    rng = np.random.default_rng(5)
    before = AL.union_logprobs._cache_size()
    for _ in range(3):
        got = al([jnp.asarray(v, jnp.float32) for v in _random_logits(rng, tables, (2,))])
    assert AL.union_logprobs._cache_size() == before + 1
    w = jnp.asarray([0.3, 0.7])
    lin = np.exp(np.asarray(brf.fuse("linear", got.logp_XnE, w), np.float64))
    want = np.einsum("n,bne->be", [0.3, 0.7], np.exp(np.asarray(got.logp_XnE, np.float64)))
    np.testing.assert_allclose(lin, want, atol=1e-6)
    for method in ("born", "loglinear", "power"):
        q = np.asarray(brf.fuse(method, got.logp_XnE, w), np.float64)
        assert not np.isnan(q).any() and np.allclose(np.exp(q).sum(-1), 1.0, atol=1e-5)
    topk = A.make_aligner("topk_union", tables)([jnp.asarray(v, jnp.float32) for v in
                                                  _random_logits(rng, tables, (2,))], k=4)
    q = np.asarray(brf.fuse("born", topk.logp_XnE, w), np.float64)
    assert not np.isnan(q).any() and np.allclose(np.exp(q).sum(-1), 1.0, atol=1e-5)


# ----------------------------------------------------------------------------- reencode

def _replay(codec, text: bytes, rng: random.Random, max_chunk: int = 5):
    """Feeds `text` in random byte chunks; checks every step and returns the tokens."""
    state = A.start(codec)
    stream: list[int] = []
    pos, retracts = 0, 0
    while pos < len(text):
        chunk = text[pos:pos + rng.randint(1, max_chunk)]
        pos += len(chunk)
        step = A.reencode(codec, state, chunk)
        assert step.n_retract <= len(stream)
        stream = stream[:len(stream) - step.n_retract] + list(step.pending)
        retracts += step.n_retract > 0
        state = step.state
        assert tuple(stream) == state.ids
        assert codec.table.decode(stream) == text[:pos]  # no byte lost or duplicated
        assert stream == A.encode_bytes(codec, text[:pos])  # canonical, as whole-text encoding
    return stream, retracts


def test_reencode_toy_boundary(toys):
    toks, tables = toys
    for tok, t in zip(toks, tables):
        codec = A.make_codec(tok, t)
        s1 = A.reencode(codec, A.start(codec), b"x the")
        s2 = A.reencode(codec, s1.state, b"ory")
        assert s2.n_retract == 1 and t.decode(s2.pending) == b" theory"
        assert len(s2.pending) == 1
        # a 2-byte character split across steps: byte token first, then merged
        s3 = A.reencode(codec, s2.state, b"\xc3")
        assert t.decode(s3.pending) == b"\xc3"
        s4 = A.reencode(codec, s3.state, b"\xa9")
        assert s4.n_retract == 1 and t.decode(s4.pending) == "é".encode()


def test_reencode_keeps_prompt_control_tokens(toys):
    toks, tables = toys
    codec = A.make_codec(toks[0], tables[0])
    v = toks[0].get_vocab()
    prompt = [v["<|im_end|>"], v["a"], v["Ġthe"]]
    state = A.from_ids(codec, prompt)
    assert state.floor == 1 and state.text == b"a the"
    step = A.reencode(codec, state, b"ory")
    assert step.state.ids[:2] == (v["<|im_end|>"], v["a"]) and step.n_retract == 1
    assert step.pending == (v["Ġtheory"],)
    step = A.reencode(codec, A.from_ids(codec, [v["<|im_end|>"]]), b"ab")
    assert step.n_retract == 0 and step.pending == (v["ab"],)


def test_reencode_frozen_prefix_never_changes(toys):
    toks, tables = toys
    rng = random.Random(7)
    alphabet = list("the ory ab\n") + ["é", "€", " theory"]
    for tok, t in zip(toks, tables):
        codec = A.make_codec(tok, t)
        for _ in range(20):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))).encode()
            state, stream, read, pos = A.start(codec), [], 0, 0
            while pos < len(text):
                chunk = text[pos:pos + rng.randint(1, 4)]
                pos += len(chunk)
                step = A.reencode(codec, state, chunk, frozen=read)
                assert step.n_retract <= len(stream) - read  # only unread tokens retracted
                stream = stream[:len(stream) - step.n_retract] + list(step.pending)
                state = step.state
                assert t.decode(stream) == text[:pos]
                # text after the read tokens is encoded canonically on its own
                end = state.ends[read - 1] if read else 0
                assert stream[read:] == A.encode_bytes(codec, text[end:pos])
                if rng.random() < 0.4:
                    read = len(stream)  # a catch-up reads everything pending
        # pure appending never retracts
        s1 = A.reencode(codec, A.start(codec, b"x the"), b"ory", frozen=2)
        assert s1.n_retract == 0 and t.decode(s1.pending) == b"ory"


def test_reencode_roundtrip_toys(toys):
    toks, tables = toys
    rng = random.Random(0)
    alphabet = list("the ory ab\n") + ["é", "€", "😀", " theory"]
    for tok, t in zip(toks, tables):
        codec = A.make_codec(tok, t)
        for _ in range(30):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))).encode()
            stream, _ = _replay(codec, text, rng)
            assert t.decode(stream) == text


# ----------------------------------------------------------------------------- real tokenizers

REAL = ("smollm2-135m-instruct", "gemma3-270m")


@pytest.fixture(scope="module")
def real():
    try:
        toks = [A.load_tokenizer(n) for n in REAL]
    except FileNotFoundError as e:
        pytest.skip(f"real model packages not installed: {e}")
    tables = [A.load_token_table(n) for n in REAL]
    return toks, tables, A.union_table(tables, A.default_cache_dir())


def test_real_union_sizes(real, record_property):
    toks, tables, u = real
    s = u.stats()
    record_property("union_stats", s)
    print("union stats", s)
    assert [t.kind for t in tables] == [A.BYTE_LEVEL, A.SENTENCEPIECE]
    assert s["member_vocab"] == [49152, 262144]
    assert s["shared_by_all"] + sum(s["only_in"]) == s["text_strings"]
    assert s["shared_by_all"] > 40000  # most of SmolLM2's strings are Gemma strings too
    # measured: 258776 events, 46145 shared, 2990 only SmolLM2, 209640 only Gemma 3
    assert (tables[0].control_V.sum(), tables[1].control_V.sum()) == (17, 6249)


def test_real_known_strings(real):
    toks, tables, u = real
    sm, ge = toks
    vs, vg = sm.get_vocab(), ge.get_vocab()
    the = u.event_id(b" the")
    assert u.index[0][vs["Ġthe"]] == the and u.index[1][vg["▁the"]] == the
    nl = u.event_id(b"\n")
    assert u.index[0][vs["Ċ"]] == nl
    assert u.index[1][vg["\n"]] == nl and u.index[1][vg["<0x0A>"]] == nl  # duplicate
    assert u.index[0][sm.eos_token_id] == A.CONTROL and u.index[1][ge.eos_token_id] == A.CONTROL
    assert u.index[1][vg["<end_of_turn>"]] == A.CONTROL
    # multi-byte characters that a tokenizer splits into single-byte tokens
    for tok, i, ch in ((sm, 0, "\U0001F9EC"), (ge, 1, "\U00020000")):
        ids = tok.encode(ch, add_special_tokens=False)
        assert len(ids) >= 2
        assert tables[i].decode(ids) == ch.encode()
        events = [int(u.index[i][t]) for t in ids]
        assert b"".join(u.strings[e] for e in events) == ch.encode()
    ge_ids = ge.encode("\U00020000", add_special_tokens=False)  # F0 A0 80 80, <0xNN> tokens
    assert [u.strings[u.index[1][t]] for t in ge_ids] == [b"\xf0", b"\xa0", b"\x80", b"\x80"]
    # ... the same byte events as SmolLM2's byte tokens 'ð', 'ł', 'Ģ'
    assert [u.index[0][vs[c]] for c in "ðłĢ"] == [u.index[1][t] for t in ge_ids[:3]]


def test_real_token_bytes_match_decode(real):
    toks, tables, _ = real
    rng = np.random.default_rng(0)
    for tok, t in zip(toks, tables):
        ids = rng.choice(t.size, 3000, replace=False)
        for i in ids:
            b = t.token_bytes[i]
            if t.control_V[i]:
                continue
            try:
                s = b.decode()
            except UnicodeDecodeError:
                continue
            assert tok.decode([int(i)]) == s, (i, b)


def test_real_aligned_sum_to_one(real):
    toks, tables, u = real
    rng = np.random.default_rng(1)
    logits = [jnp.asarray(x, jnp.float32) for x in _random_logits(rng, tables, (2,), 3.0)]
    union = A.make_aligner("union", tables)(logits)
    p = np.exp(np.asarray(union.logp_XnE, np.float64))
    assert p.shape == (2, 2, u.size)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    for i, (t, x) in enumerate(zip(tables, logits)):
        q = np.asarray(jax.nn.softmax(np.asarray(x, np.float64), -1))
        np.testing.assert_allclose(p[:, i, A.CONTROL], q[:, t.control_V].sum(-1), rtol=1e-4)
    topk = A.make_aligner("topk_union", tables)(logits, k=32)
    pk = np.exp(np.asarray(topk.logp_XnE, np.float64))
    np.testing.assert_allclose(pk.sum(-1), 1.0, atol=1e-5)
    kept = np.asarray(topk.info["kept_Xn"])
    assert ((kept > 0) & (kept <= 1 + 1e-6)).all()


def test_real_identity_exact(real):
    toks, tables, _ = real
    rng = np.random.default_rng(2)
    x = [jnp.asarray(v, jnp.float32) for v in _random_logits(rng, [tables[0]] * 2, (2,))]
    got = A.make_aligner("identity", [tables[0]] * 2)(x)
    ref = np.stack([np.asarray(v, np.float64) for v in x], -2)
    ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(got.logp_XnE, np.float64), ref, atol=2e-6)
    # union of a vocabulary with itself is its token distribution, control pooled
    al = A.make_aligner("union", [tables[0]] * 2)
    same, u = al(x), al.union
    p = np.exp(np.asarray(same.logp_XnE, np.float64))
    text = ~tables[0].control_V
    np.testing.assert_allclose(p[..., u.index[0][text]], np.exp(ref[..., text]), rtol=1e-4,
                               atol=1e-9)


@pytest.mark.parametrize("which", [0, 1])
def test_real_reencode_roundtrip(real, which):
    toks, tables, _ = real
    codec = A.make_codec(toks[which], tables[which])
    rng = random.Random(which)
    alphabet = (list("abcdefghij klmnop the ory\n\t.,;:'\"()0123456789-")
                + ["é", "€", "😀", "中文", "—", "ß", "ñ", " theory", "Hello", " world", "  ",
                   "\n\n", "ドイツ", "👍🏽", "Ω"])
    retracts = 0
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))).encode()
        stream, r = _replay(codec, text, rng, max_chunk=6)
        retracts += r
        assert codec.table.decode(stream) == text
        assert stream == toks[which].encode(text.decode(), add_special_tokens=False)
    assert retracts > 0  # the boundary problem did occur and was handled
