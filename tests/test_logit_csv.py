"""Logit CSVs: format round trips, hand-written files, agreement with the
validation experiment, resuming, and one-line errors from the mains."""

import csv
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from brf.eval import logit_csv as lc
from brf.eval import csv_analysis

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXT = ("HAMLET. To be, or not to be, that is the question: Whether 'tis nobler in the "
        "mind to suffer The slings and arrows of outrageous fortune, Or to take arms "
        "against a sea of troubles, And by opposing end them? To die, to sleep; No more; "
        "and by a sleep to say we end The heart-ache and the thousand natural shocks "
        "That flesh is heir to: 'tis a consummation Devoutly to be wish'd. To die, to "
        "sleep. To sleep, perchance to dream - ay, there's the rub, For in that sleep of "
        "death what dreams may come, When we have shuffled off this mortal coil, Must "
        "give us pause. #2: costs 100 ducats, \"quoted\", a\\b, caf\u00e9.\n")


@given(st.binary(max_size=40))
def test_escape_round_trip_and_field_safety(data):
    field = lc.escape_bytes(data)
    assert lc.unescape(field) == (data, False)
    assert field.isascii() and not set(field) & set(',"#\n\r\t')


def test_control_tokens_are_distinct_from_text():
    assert lc.unescape(lc.escape_token(b"", True, "<|im_end|>")) == (b"", True)
    assert lc.unescape(lc.escape_bytes(b"\\!x")) == (b"\\!x", False)


def _random_block(rng, c=50, k=6, v=1000):
    """Random rows whose derived columns agree with their logits (the reader checks
    them): the token is one of the row's top k, the normaliser lies above the
    log-sum-exp of the top k and the entropy between lse - logit_1 and log(v)."""
    top = np.sort(rng.normal(0, 8, (c, k)).astype(np.float32), axis=1)[:, ::-1]
    ids = np.stack([rng.choice(v, k, replace=False) for _ in range(c)])
    pick = rng.integers(0, k, c)
    above = rng.uniform(0.1, 3.0, c).astype(np.float32)
    t64 = top.astype(np.float64)
    lse = (np.log(np.exp(t64 - t64[:, :1]).sum(1)) + t64[:, 0] + above).astype(np.float32)
    entropy = np.minimum(lse - top[:, 0] + rng.uniform(0.01, 1.5, c),
                         np.log(v) - 0.1).astype(np.float32)
    return lc.RowBlock(np.zeros(c, np.int64), np.arange(c), ids[np.arange(c), pick],
                       top[np.arange(c), pick], lse, entropy,
                       (top[:, 0] - top[:, 1]).astype(np.float32), top, ids)


def test_written_values_read_back_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    texts = np.array([lc.escape_bytes(bytes([i % 256, 44, 35])) for i in range(1000)], object)
    block = _random_block(rng)
    path = str(tmp_path / "x.csv")
    with lc.CsvWriter(path, {"vocab_size": 1000}, 6, texts, resume=False) as w:
        w.write(block)
    run = lc.read_csv(path)
    for name in ("token_logit", "lse", "entropy", "gap", "top_logits"):
        got, want = getattr(run, name), getattr(block, name)
        np.testing.assert_array_equal(got.view(np.int32), np.asarray(want).view(np.int32))
    np.testing.assert_array_equal(run.top_ids, block.top_ids)
    assert [lc.unescape(t)[0] for t in run.token_text] == [
        bytes([i % 256, 44, 35]) for i in block.token_id]
    assert run.meta["k"] == 6 and run.meta["format"] == lc.FORMAT
    # Any csv reader sees the same table once the '#' lines are dropped.
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert len(rows) == 50 and np.float32(rows[3]["logit_2"]) == block.top_logits[3, 1]


def test_writer_resume_keeps_complete_rows_and_refuses_damage(tmp_path):
    rng = np.random.default_rng(4)
    texts = np.array([lc.escape_bytes(b"t%d" % i) for i in range(1000)], object)
    block = _random_block(rng)
    path = tmp_path / "r.csv"
    with lc.CsvWriter(str(path), {"a": 1}, 6, texts, resume=False) as w:
        w.write(block)
    full = path.read_bytes()
    lines = full.split(b"\n")
    # Cut inside row 21's checksum: 20 rows are kept, the partial line dropped.
    path.write_bytes(b"\n".join(lines[:23]) + b"\n" + lines[23][:-3])
    with lc.CsvWriter(str(path), {"a": 1}, 6, texts) as w:
        assert w.done == {0: 20}
        w.write(lc.RowBlock(*(np.asarray(a)[20:] for a in block)))
    assert path.read_bytes() == full
    # A damaged row with intact rows after it is not resumed over.
    bad = lines[:10] + [lines[10].replace(b",", b";", 1)] + lines[11:]
    path.write_bytes(b"\n".join(bad))
    with pytest.raises(lc.CsvError, match="line 11 is damaged"):
        lc.CsvWriter(str(path), {"a": 1}, 6, texts)
    with pytest.raises(lc.CsvError, match=r"line 11 \(row 8\), column 'crc32'.*edited"):
        lc.read_csv(str(path))


# ---------------------------------------------------------------------------
# Real model.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    from brf.checkpoints.registry import load
    return load("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="module")
def dumps(smollm, tmp_path_factory):
    from brf.eval.dump import dump_scores
    d = tmp_path_factory.mktemp("dumps")
    plain = dump_scores(smollm, TEXT * 2, str(d / "plain.csv"), k=20, chunk=64,
                        segment_tokens=200)
    sys_ = dump_scores(smollm, TEXT * 2, str(d / "pirate.csv"), k=20, chunk=64,
                       segment_tokens=200, system="You are a pirate. Speak like one.")
    return d, plain, sys_


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_round_trip_reproduces_model_log_probs(smollm, dumps):
    """CSV logit - lse == the model's top-k log-probs to float32 precision
    (float64 log-softmax of the model's logits from the scoring path), and to
    2e-4 of one unchunked forward pass (chunking changes the last bits)."""
    from brf.eval.dump import context_ids
    from brf.models import forward, iter_logits_chunks
    d, plain, sys_ = dumps
    for name, system in (("plain", ""), ("pirate", "You are a pirate. Speak like one.")):
        run = lc.read_csv(str(d / f"{name}.csv"))
        ids = smollm.tokenizer.encode(TEXT * 2, add_special_tokens=False)
        assert run.n_rows == len(ids) >= 300
        np.testing.assert_array_equal(run.position, np.arange(len(ids)))
        np.testing.assert_array_equal(run.token_id, ids)
        ctx = context_ids(smollm, system=system)
        # The metadata names that context; SmolLM2's BOS is its chat-turn marker.
        assert run.meta["context_ids"] == ctx
        assert run.meta["context_text"] == _texts_by_tokenizer(smollm.tokenizer, ctx)
        assert run.meta["context_text"][0] == "\\!<|im_start|>"
        pad_to = -(-(len(ctx) + 200) // 64) * 64
        for a in range(0, len(ids), 200):
            seg = np.asarray(ctx + ids[a:a + 200], np.int32)
            padded = np.zeros(pad_to, np.int32)
            padded[:len(seg)] = seg
            chunks = [np.asarray(l[0]) for _, l in iter_logits_chunks(
                smollm.params, smollm.cfg, padded[None], (np.arange(pad_to) < len(seg))[None],
                chunk=64)]
            ref = _log_softmax64(np.concatenate(chunks)[len(ctx) - 1:len(seg) - 1])
            rows = slice(a, a + len(seg) - len(ctx))
            got = run.top_logp()[rows].astype(np.float64)
            tol = 4 * np.finfo(np.float32).eps * np.maximum(1.0, np.abs(ref).max())
            np.testing.assert_allclose(got, np.take_along_axis(ref, run.top_ids[rows], -1),
                                       atol=tol, rtol=0)
            np.testing.assert_allclose(got, -np.sort(-ref, -1)[:, :20], atol=tol, rtol=0)
            gold = (run.token_logit - run.lse)[rows]
            np.testing.assert_allclose(gold, ref[np.arange(len(gold)), ids[rows]],
                                       atol=tol, rtol=0)
            np.testing.assert_allclose(run.entropy[rows], -(np.exp(ref) * ref).sum(-1),
                                       atol=1e-4)
            full, _ = forward(smollm.params, smollm.cfg, jnp.asarray(seg[None]))
            ref = _log_softmax64(np.asarray(full[0])[len(ctx) - 1:-1])
            np.testing.assert_allclose(got, np.take_along_axis(ref, run.top_ids[rows], -1),
                                       atol=2e-4, rtol=0)
    # The system prompt changes the distributions (else the pair test is empty).
    a, b = lc.read_csv(str(d / "plain.csv")), lc.read_csv(str(d / "pirate.csv"))
    assert np.abs(a.top_logp()[:, 0] - b.top_logp()[:, 0]).mean() > 1e-3


def _linear_nll_by_the_rules(runs, sizes) -> float:
    """Mean NLL of the equal-weight linear pool of same-tokenizer runs over the event
    table's events (brf.eval.events), in float64: a member's top-k tokens exact, another
    member's listed token an equal share of its tail, the rest OTHER; a gold nobody
    lists scores OTHER times its mean share of the members' tails."""
    out = []
    for q in range(runs[0].n_rows):
        tops = [dict(zip(r.top_ids[q].tolist(),
                         np.exp(r.top_logits[q].astype(np.float64) - r.lse[q]))) for r in runs]
        listed = set().union(*tops)
        gold = int(runs[0].token_id[q])
        probs = []
        for top, v in zip(tops, sizes):
            tail = 1.0 - sum(top.values())
            share = tail / (v - len(top))
            if gold in listed:
                probs.append(top.get(gold, share))
            else:
                probs.append(tail - share * len(listed - set(top)))
        q_gold = np.mean(probs)
        if gold not in listed:
            q_gold *= np.mean([np.exp(r.token_logit[q] - r.lse[q]) / (1.0 - sum(t.values()))
                               for r, t in zip(runs, tops)])
        out.append(-np.log(q_gold))
    return float(np.mean(out))


def test_phase_analysis_matches_hypotheses_on_same_positions(dumps):
    """Same tokenizer, with and without a system prompt: the analysis is
    brf.eval.hypotheses on the validation's event table of these positions,
    with gaps and gold log-probs read off the CSVs (recomputed here in float64)."""
    d, *_ = dumps
    paths = [str(d / "plain.csv"), str(d / "pirate.csv")]
    rep, arr = csv_analysis.analyze(paths, n_perm=200, n_boot=100)
    runs = [lc.read_csv(p) for p in paths]
    assert rep["align"] == "position" and rep["positions"] == runs[0].n_rows
    rows = {r["phase_map"]: r for r in rep["phase_coherence"]}
    # tanh(scale=1.5, rate=0.5) of the top-1/top-2 gap, independent NumPy.
    phi = [1.5 * np.tanh(0.5 * (r.top_logits[:, 0].astype(np.float64) - r.top_logits[:, 1]))
           for r in runs]
    diff = np.angle(np.exp(1j * (phi[0] - phi[1])))
    rbar = abs(np.mean(np.exp(1j * diff)))
    assert rows["tanh"]["n"] == len(diff)
    assert rows["tanh"]["mean_resultant_length"] == pytest.approx(rbar, rel=1e-6)
    # Per-token maps read the event table as the validation does (x = max event
    # log-prob minus the gold's; OTHER counts as an event there): checked against
    # the validation's own route in the cross-tokenizer test below.
    # Linear pool NLL from the CSVs by hand, by the event table's rules.
    lin = [f for f in rep["fusion"] if f["label"] == "linear"][0]
    assert lin["nll"] == pytest.approx(_linear_nll_by_the_rules(
        runs, [r.meta["vocab_size"] for r in runs]), rel=1e-5)


def test_phase_analysis_matches_validation_pipeline_across_tokenizers(smollm, tmp_path):
    """Two tokenizers: the CSV route (dump, byte co-alignment) and the
    validation's route (score_segments + build_event_table) find the same
    co-aligned positions and give the same Phase Coherence statistics."""
    from brf.checkpoints.registry import load
    from brf.eval import hypotheses
    from brf.eval.dump import dump_scores
    from brf.eval.events import build_event_table
    from brf.eval.scorer import encode as _encode, member_token_bytes
    from brf.eval.scoring import score_segments
    gemma = load("gemma3-270m", progress=False)
    text = TEXT[:600]
    maps = {"tanh": "tanh(scale=1.5, rate=0.5)", "token_log1p": "token_log1p(scale=0.5)"}
    scores, tbs, paths = [], [], []
    for name, m in (("smollm", smollm), ("gemma", gemma)):
        scores.append(score_segments(m.params, m.cfg, [_encode(m.tokenizer, m.cfg, text)],
                                     top_k=20, desc=name))
        tbs.append(member_token_bytes(m.tokenizer, m.cfg.vocab_size))
        paths.append(str(tmp_path / f"{name}.csv"))
        dump_scores(m, text, paths[-1], k=20)
    table, cov = build_event_table(scores, tbs, [text])
    want = hypotheses.phase_coherence(table, maps, n_perm=300, seed=0)
    rep, _ = csv_analysis.analyze(paths, phase_maps=maps, n_perm=300, n_boot=50, seed=0)
    assert rep["align"] == "bytes"
    assert rep["positions"] == cov.positions == table.n_positions
    assert cov.positions < min(cov.member_positions)  # alignment did drop positions
    for got, ref in zip(rep["phase_coherence"], want):
        assert got["n"] == ref["n"]
        for key in ("mean_resultant_length", "rayleigh_z", "mean_direction"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
        assert got["permutation_p"] == pytest.approx(ref["permutation_p"], abs=0.02)


def test_resume_after_interruption(smollm, dumps, tmp_path):
    from brf.eval.dump import dump_scores
    d, plain, _ = dumps
    full = (d / "plain.csv").read_bytes()
    lines = full.split(b"\n")
    cut = len(b"\n".join(lines[:3 + 130])) + 1 + 57  # 130 rows and part of the next
    path = tmp_path / "cut.csv"
    path.write_bytes(full[:cut])
    with pytest.raises(lc.CsvError, match=r"line 134 \(row 131\), column 'crc32'.*partial"):
        lc.read_csv(str(path))
    out = dump_scores(smollm, TEXT * 2, str(path), k=20, chunk=64, segment_tokens=200)
    assert out["rows_written"] == plain["rows"] - 130
    assert path.read_bytes() == full
    # Complete already: nothing to do.
    assert dump_scores(smollm, TEXT * 2, str(path), k=20, chunk=64,
                       segment_tokens=200)["rows_written"] == 0
    # Different settings are refused, not mixed into the file.
    with pytest.raises(lc.CsvError, match="different settings.*prefix"):
        dump_scores(smollm, TEXT * 2, str(path), k=20, chunk=64, segment_tokens=200,
                    prefix="Once:")


def test_generation_dump_and_resume(smollm, tmp_path):
    from brf.eval.dump import dump_generations
    path = str(tmp_path / "gen.csv")
    kw = dict(k=5, max_new_tokens=6, sampler="temperature=0.8", seed=3)
    out = dump_generations(smollm, ["Say hi.", "Name a colour."], path, **kw)
    run = lc.read_csv(path)
    assert set(run.seq.tolist()) == {0, 1} and out["rows"] == run.n_rows
    # The chosen token's logit is the logit of that id.
    in_top = run.top_ids == run.token_id[:, None]
    np.testing.assert_array_equal(run.top_logits[in_top],
                                  run.token_logit[in_top.any(1)])
    full = pathlib.Path(path).read_bytes()
    keep = full[:full.rfind(b"\n", 0, len(full) - 200)]  # lose the last rows and cut one
    pathlib.Path(path).write_bytes(keep)
    dump_generations(smollm, ["Say hi.", "Name a colour."], path, **kw)
    assert pathlib.Path(path).read_bytes() == full


def _texts_by_tokenizer(tok, ids):
    """Each token's text field from the tokenizer alone (an independent route)."""
    special = set(tok.all_special_ids)
    return [("\\!" + tok.convert_ids_to_tokens(i)) if i in special
            else lc.escape_bytes(tok.decode([i]).encode()) for i in ids]


def test_dump_records_its_context_and_old_files_still_resume(tmp_path):
    """The metadata names the context tokens (ids and texts) the dump read before the
    text; a file written before those keys existed reads the same and resumes."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_lm import tiny_member
    from brf.eval.dump import dump_generations, dump_scores
    model = tiny_member(0)
    tok = model.tokenizer
    path = tmp_path / "ctx.csv"
    kw = dict(k=4, chunk=32, segment_tokens=40, system="Be brief.", prefix="Q: ")
    out = dump_scores(model, TEXT[:300], str(path), **kw)
    meta = lc.read_csv(str(path)).meta
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."}], tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    want = [tok.bos_token_id] + chat[1:] + tok.encode("Q: ", add_special_tokens=False)
    assert chat[0] == tok.bos_token_id and meta["context_ids"] == want
    assert meta["context_tokens"] == len(want)
    assert meta["context_text"] == _texts_by_tokenizer(tok, want)
    assert meta["context_text"][0] == "\\!<s>"
    assert b"".join(lc.unescape(f)[0] for f in meta["context_text"]) == (
        b"system: Be brief.\nQ: ")
    # Generation: one context per prompt, the whole wrapped prompt.
    gen = tmp_path / "gen.csv"
    dump_generations(model, ["Hi.", "Name a colour."], str(gen), k=4, max_new_tokens=1)
    gmeta = lc.read_csv(str(gen)).meta
    for ids, texts, prompt in zip(gmeta["context_ids"], gmeta["context_text"],
                                  ["Hi.", "Name a colour."], strict=True):
        ref = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True)
        assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
        assert texts == _texts_by_tokenizer(tok, ids)
    # A file from before the context keys: same rows, older metadata line.
    lines = path.read_bytes().split(b"\n")
    old = {k: v for k, v in meta.items() if k not in ("context_ids", "context_text")}
    lines[1] = b"# " + json.dumps(old).encode()
    path.write_bytes(b"\n".join(lines[:-6]) + b"\n")  # and interrupted: rows missing
    run = lc.read_csv(str(path))
    assert "context_ids" not in run.meta and run.n_rows == out["rows"] - 5
    again = dump_scores(model, TEXT[:300], str(path), **kw)
    assert again["rows_written"] == 5 and again["rows"] == out["rows"]
    assert lc.read_csv(str(path)).meta == old  # resumed in place, metadata kept


# ---------------------------------------------------------------------------
# A CSV written by hand (no brf writer), the minimal columns.
# ---------------------------------------------------------------------------


def _hand_csv(path, logits_RxK, ids_RxK, lse, tok, tok_logit, positions=None,
              extra_header=None, bad=None, derived=None):
    """Writes the documented columns with the csv module; quoted fields allowed.
    ``derived``: optional columns ({'gap': [R], 'entropy': [R]}) written too."""
    r, k = logits_RxK.shape
    derived = derived or {}
    header = (["position", "token_id", "token_logit", "lse", *derived]
              + [f"logit_{j + 1}" for j in range(k)] + [f"id_{j + 1}" for j in range(k)])
    if extra_header:
        header = [h for h in header if h != extra_header]
    with open(path, "w", newline="") as f:
        f.write("# written by another tool\n")
        w = csv.writer(f, quoting=csv.QUOTE_NONNUMERIC if bad == "quote" else csv.QUOTE_MINIMAL)
        w.writerow(header)
        for i in range(r):
            row = {"position": i if positions is None else positions[i], "token_id": tok[i],
                   "token_logit": repr(float(tok_logit[i])), "lse": repr(float(lse[i]))}
            row.update({f"logit_{j + 1}": repr(float(logits_RxK[i, j])) for j in range(k)})
            row.update({f"id_{j + 1}": int(ids_RxK[i, j]) for j in range(k)})
            row.update({name: repr(float(v[i])) for name, v in derived.items()})
            if bad == "text" and i == 7:
                row["logit_3"] = "twelve"
            w.writerow([row[h] for h in header])


def _hand_pair(tmp_path, rng, n=120, k=5, v=50):
    out = []
    base = rng.normal(0, 2, (n, v))
    for m in range(2):
        logits = base + rng.normal(0, 1.0, (n, v))
        order = np.argsort(-logits, 1)[:, :k]
        top = np.take_along_axis(logits, order, 1)
        lse = np.log(np.exp(logits).sum(1))
        tok = rng.integers(0, v, n) if m == 0 else out[0][4]
        out.append((logits, top, order, lse, tok, logits[np.arange(n), tok]))
    paths = []
    for m, (logits, top, order, lse, tok, tl) in enumerate(out):
        paths.append(str(tmp_path / f"hand{m}.csv"))
        _hand_csv(paths[-1], top, order, lse, tok, tl)
    return paths, out


def test_hand_written_csv_is_read_and_analysed(tmp_path):
    rng = np.random.default_rng(1)
    paths, members = _hand_pair(tmp_path, rng)
    rep, _ = csv_analysis.analyze(paths, vocab_sizes=[50, 50], n_perm=100, n_boot=50)
    assert rep["positions"] == 120 and rep["align"] == "position"
    # Phase coherence of the tanh map, by hand in float64.
    phi = [1.5 * np.tanh(0.5 * (m[1][:, 0] - m[1][:, 1])) for m in members]
    rbar = abs(np.mean(np.exp(1j * (phi[0] - phi[1]))))
    row = [r for r in rep["phase_coherence"] if r["phase_map"] == "tanh"][0]
    assert row["mean_resultant_length"] == pytest.approx(rbar, rel=1e-5)
    # Linear pool, by the event table's rules in float64.
    lin = [f for f in rep["fusion"] if f["label"] == "linear"][0]
    assert lin["nll"] == pytest.approx(
        _linear_nll_by_the_rules([lc.read_csv(p) for p in paths], [50, 50]), rel=1e-5)
    # The tail rule: mass outside a member's listed tokens is shared over V - listed.
    table = csv_analysis.load_table(paths, vocab_sizes=[50, 50])[2]
    np.testing.assert_allclose(np.exp(table.logp.astype(np.float64)).sum(-1), 1.0, atol=1e-5)
    # Every registered method that needs no extra input (the bottleneck methods need the
    # members' unembeddings, which a CSV does not carry).
    assert sorted(f["method"] for f in rep["fusion"][2:]) == sorted(
        csv_analysis.default_methods())
    assert {"born", "linear", "loglinear"} <= set(csv_analysis.default_methods())
    assert not any(m.startswith("bottleneck") for m in csv_analysis.default_methods())
    # Issue 54: born_shuffled was an error row on every run (its phase map was lost on
    # the way); its NLL is brf.fuse's on the event table, at the method's defaults.
    assert not [f for f in rep["fusion"] if "error" in f], rep["fusion"]
    import brf
    lq = np.asarray(brf.fuse("born_shuffled", table.logp, np.full(2, 0.5)), np.float64)
    nll = -lq[np.arange(len(table.gold)), table.gold] - table.offset
    (row,) = [f for f in rep["fusion"] if f["method"] == "born_shuffled"]
    assert row["nll"] == pytest.approx(nll.mean(), rel=1e-5)


def _broken(kind, top, order, lse, positions):
    """One row (row 6, line 8 of a _hand_csv file) broken as ``kind`` says."""
    top, order, lse, positions = top.copy(), order.copy(), lse.copy(), positions.copy()
    if kind == "repeated id":
        order[5, 1] = order[5, 0]
    elif kind == "ascending logits":
        top[5, [0, 1]] = top[5, [1, 0]] + np.array([0.0, 0.5])
    elif kind == "lse below the top":
        lse[5] = top[5, 0] - 1.0
    elif kind == "duplicate position":
        positions[6] = positions[5]
    elif kind == "id beyond the vocabulary":
        order[5, 0] = 999_999_999
    return top, order, lse, positions


@pytest.mark.parametrize("kind,pattern", [
    ("repeated id", r"line 8 \(row 6\), column 'id_2': id \d+ repeats id_1"),
    ("ascending logits", r"line 8 \(row 6\), column 'logit_2': .* is above logit_1"),
    ("lse below the top", r"line 8 \(row 6\), column 'lse': .* is below the log-sum-exp "
                          r"of the row's top logits"),
    ("duplicate position", r"line 9 \(row 7\), column 'position': \(seq 0, position 5\) "
                           r"is also line 8"),
    ("id beyond the vocabulary", r"line 8 \(row 6\), column 'id_1': token id 999999999 is "
                                 r"not in \[0, 50\)"),
])
def test_rows_that_break_their_columns_promises_are_refused(tmp_path, kind, pattern):
    """Issue 54: analyze_csv printed numbers for impossible CSVs. A row's top ids are
    distinct tokens below V, its logits descend, lse is at least the log-sum-exp of
    its top logits, a (seq, position) has one row; the first row that breaks one is
    named (file, line, row, column). The intact file reads."""
    rng = np.random.default_rng(4)
    _, members = _hand_pair(tmp_path, rng, n=12)
    logits, top, order, lse, tok, tl = members[0]
    p = str(tmp_path / "ok.csv")
    _hand_csv(p, top, order, lse, tok, tl)
    assert lc.read_csv(p, vocab_size=50).n_rows == 12
    top, order, lse, pos = _broken(kind, top, order, lse, np.arange(12))
    p = str(tmp_path / "broken.csv")
    _hand_csv(p, top, order, lse, tok, tl, positions=pos)
    with pytest.raises(lc.CsvError, match=r"broken\.csv: " + pattern):
        lc.read_csv(p, vocab_size=50)


def _entropy(logits):
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    return -(np.exp(logp) * logp).sum(1)


@pytest.mark.parametrize("kind,pattern", [
    ("gap", r"column 'gap': 7 but the row's logit_1 - logit_2 = "),
    ("token_logit of a listed token", r"column 'token_logit': .* but token_id \d+ is id_2, "
                                      r"whose logit is"),
    ("token_logit of an unlisted token", r"column 'token_logit': .* is above logit_5 = .* "
                                         r"but token_id \d+ is not among the row's top 5"),
    ("entropy below -log p_1", r"column 'entropy': 0.001\d* is below -log p_1"),
    ("entropy above log V", r"column 'entropy': 9 is above log\(vocab size\) = 3.9"),
])
def test_derived_columns_the_logits_contradict_are_refused(tmp_path, kind, pattern):
    """Issue 71: a gap of 7.0 that the row's own logits contradict was analysed (the
    coherence statistics changed). gap, token_logit and entropy are checked against
    the logits they summarise; the first contradicted value is named (file, line, row,
    column). The consistent file reads."""
    rng = np.random.default_rng(4)
    _, members = _hand_pair(tmp_path, rng, n=12)
    logits, top, order, lse, tok, tl = members[0]
    derived = {"gap": top[:, 0] - top[:, 1], "entropy": _entropy(logits)}
    p = str(tmp_path / "ok.csv")
    _hand_csv(p, top, order, lse, tok, tl, derived=derived)
    assert lc.read_csv(p, vocab_size=50).n_rows == 12
    tok, tl = tok.copy(), tl.copy()
    derived = {k: v.copy() for k, v in derived.items()}
    if kind == "gap":
        derived["gap"][5] = 7.0
    elif kind == "token_logit of a listed token":
        tok[5], tl[5] = order[5, 1], top[5, 1] - 0.25
    elif kind == "token_logit of an unlisted token":
        tok[5] = np.setdiff1d(np.arange(50), order[5])[0]
        tl[5] = top[5, 4] + 0.5
    elif kind == "entropy below -log p_1":
        derived["entropy"][5] = 0.001
    else:
        derived["entropy"][5] = 9.0
    p = str(tmp_path / "broken.csv")
    _hand_csv(p, top, order, lse, tok, tl, derived=derived)
    with pytest.raises(lc.CsvError, match=r"broken\.csv: line 8 \(row 6\), " + pattern):
        lc.read_csv(p, vocab_size=50)


def test_the_same_run_given_twice_is_refused(tmp_path):
    """Issue 71: one CSV given twice was analysed (R-bar = 1.000, AUROC 0.96) without a
    word. The same file by two paths, or a copy (other comments, other number
    format: the same rows) is refused naming both; two runs are not."""
    rng = np.random.default_rng(2)
    paths, members = _hand_pair(tmp_path, rng, n=20)
    logits, top, order, lse, tok, tl = members[0]
    copy = str(tmp_path / "copy.csv")
    _hand_csv(copy, top, order, lse, tok, tl, bad="quote")  # quoted fields: another file
    (tmp_path / "sub").mkdir()
    link = tmp_path / "sub" / "link.csv"
    link.symlink_to(paths[0])
    for given, pattern in (([paths[0], paths[0]], r"hand0\.csv is the same file as .*hand0"),
                           ([paths[0], str(link)], r"link\.csv is the same file as "),
                           ([paths[0], paths[1], copy], r"copy\.csv holds the same rows as "
                                                        r".*hand0\.csv")):
        with pytest.raises(csv_analysis.UserError, match=pattern):
            csv_analysis.load_table(given, vocab_sizes=[50] * len(given))
    assert csv_analysis.load_table(paths, vocab_sizes=[50, 50])[2].n_positions == 20


def test_analysis_progress_names_each_stage(tmp_path, capsys):
    """Issue 54: analyze_csv was silent for minutes on a large CSV; with progress it
    says what it reads and computes (the main turns it on at a terminal)."""
    paths, _ = _hand_pair(tmp_path, np.random.default_rng(6), n=30)
    csv_analysis.analyze(paths, vocab_sizes=[50, 50], n_perm=10, n_boot=10,
                         methods=["linear"], progress=True)
    err = capsys.readouterr().err
    for needle in (f"reading {paths[0]}", "event table: 30 position-aligned positions",
                   "phase coherence: 6 maps, 10 permutations",
                   "cross-term test: 10 bootstrap replicates"):
        assert needle in err, err


def test_missing_entropy_column_is_reported_as_not_available(tmp_path):
    """A CSV without the optional entropy column: the summary says its mean entropy is
    not available (it said nan, issue 37); a CSV with the column gives its mean."""
    rng = np.random.default_rng(2)
    paths, _ = _hand_pair(tmp_path, rng, n=40)
    rep, _ = csv_analysis.analyze(paths, vocab_sizes=[50, 50], n_perm=20, n_boot=20)
    assert all("entropy_mean" not in m for m in rep["inputs"])
    md = csv_analysis.markdown(rep)
    rows = [ln for ln in md.splitlines() if ln.startswith(("| 0: ", "| 1: "))]
    assert len(rows) == 2, md
    for row in rows:
        assert row.endswith("| not available (no entropy column) |"), row
        assert "nan" not in row.lower(), row
    rep["inputs"][0]["entropy_mean"] = 1.23456
    (row,) = [ln for ln in csv_analysis.markdown(rep).splitlines() if ln.startswith("| 0: ")]
    assert row.endswith("| 1.235 |"), row


def _two_tokenizer_pair(tmp_path, rng, n=60, k=5, sizes=(50, 60)):
    """Two metadata-less CSVs of one text by two 'tokenizers' that split it the same
    way (one letter per token) but number their tokens differently (vocabularies of
    50 and 60): same positions, different ids, so only byte alignment pairs them."""
    letters = [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN"]
    text = rng.integers(0, len(letters), n)
    base = rng.normal(0, 2, (n, len(letters)))
    paths = []
    for m, v in enumerate(sizes):
        id_of = (np.arange(len(letters)) * (1 if m == 0 else 7) + 3 * m) % v
        logits = base + rng.normal(0, 1.0, base.shape)
        order = np.argsort(-logits, 1)[:, :k]
        lse = np.log(np.exp(logits).sum(1))
        header = (["position", "token_id", "token_text", "token_logit", "lse"]
                  + [f"logit_{j + 1}" for j in range(k)] + [f"id_{j + 1}" for j in range(k)]
                  + [f"text_{j + 1}" for j in range(k)])
        paths.append(str(tmp_path / f"tok{m}.csv"))
        with open(paths[-1], "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            for i, t in enumerate(text):
                w.writerow([i, id_of[t], letters[t].decode(), repr(float(logits[i, t])),
                            repr(float(lse[i]))]
                           + [repr(float(logits[i, o])) for o in order[i]]
                           + [int(id_of[o]) for o in order[i]]
                           + [letters[o].decode() for o in order[i]])
    return paths


def test_auto_alignment_reads_the_given_vocabulary_sizes(tmp_path):
    """Without metadata, align=auto takes the vocabulary sizes from vocab_sizes: two
    sizes mean two tokenizers, compared on co-aligned bytes (here every position)."""
    paths = _two_tokenizer_pair(tmp_path, np.random.default_rng(5))
    runs, rows, table, align = csv_analysis.load_table(paths, vocab_sizes=[50, 60])
    assert align == "bytes" and table.n_positions == 60
    np.testing.assert_array_equal(rows, np.stack([np.arange(60)] * 2, 1))
    # Equal sizes keep position alignment, whose refusal names the way out.
    with pytest.raises(lc.CsvError, match=r"token_id .*not on the same positions.*"
                                          r"--config\.align=bytes"):
        csv_analysis.load_table(paths, vocab_sizes=[60, 60])
    # ... and a size below a file's ids is refused by name (issue 54).
    with pytest.raises(lc.CsvError, match=r"tok1.csv: line \d+ \(row \d+\), column "
                                          r"'(token_id|id_\d)': token id \d+ is not in "
                                          r"\[0, 50\)"):
        csv_analysis.load_table(paths, vocab_sizes=[50, 50])
    with pytest.raises(csv_analysis.UserError, match="2 vocabulary sizes for 3 CSVs"):
        csv_analysis.load_table(paths + paths[:1], vocab_sizes=[50, 60])
    r = _main("analyze_csv.py", f"--config={ROOT}/configs/analyze_csv.py:tiny",
              f"--config.csvs={','.join(paths)}", f"--config.out_dir={tmp_path}/out",
              "--config.vocab_sizes=50,60", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    import json
    assert json.load(open(tmp_path / "out" / "analysis.json"))["align"] == "bytes"


# ---------------------------------------------------------------------------
# Bad input through the mains: one stderr line, exit status 2.
# ---------------------------------------------------------------------------


def _main(script, *args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(ROOT / "experiments" / script), *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def _analyze(paths, cwd, *extra):
    return _main("analyze_csv.py", f"--config={ROOT}/configs/analyze_csv.py:tiny",
                 f"--config.csvs={','.join(paths)}", f"--config.out_dir={cwd}/out",
                 "--config.vocab_sizes=50,50", *extra, cwd=cwd)


def _bad_inputs(tmp_path):
    rng = np.random.default_rng(2)
    paths, members = _hand_pair(tmp_path, rng, n=20)
    logits, top, order, lse, tok, tl = members[1]
    cases = {}
    p = str(tmp_path / "nocol.csv")
    _hand_csv(p, top, order, lse, tok, tl, extra_header="lse")
    cases["missing column"] = ([paths[0], p], r"nocol\.csv: line 2: missing column 'lse'")
    p = str(tmp_path / "shifted.csv")
    pos = np.arange(20)
    pos[9:] += 1
    _hand_csv(p, top, order, lse, tok, tl, positions=pos)
    cases["mismatched positions"] = (
        [paths[0], p], r"shifted\.csv: line 12 \(row 10\), column 'position': position 10 "
                       r"where .*hand0\.csv line 12 has 9.*use --config\.align=bytes")
    p = str(tmp_path / "text.csv")
    _hand_csv(p, top, order, lse, tok, tl, bad="text")
    cases["non-numeric"] = ([paths[0], p], r"text\.csv: line 10 \(row 8\), column 'logit_3': "
                                           r"'twelve' is not a number")
    p = str(tmp_path / "binary.csv")
    pathlib.Path(p).write_bytes(bytes(range(256)) * 4)
    cases["bad file"] = ([paths[0], p], r"binary\.csv: not a text \(UTF-8\) file")
    cases["no file"] = ([paths[0], str(tmp_path / "nope.csv")], r"nope\.csv: cannot read")
    cases["one run twice"] = ([paths[0], paths[0]], r"hand0\.csv is the same file as ")
    p = str(tmp_path / "gap.csv")
    gap = top[:, 0] - top[:, 1]
    gap[3] = 7.0
    _hand_csv(p, top, order, lse, tok, tl, derived={"gap": gap})
    cases["gap contradicted"] = ([paths[0], p], r"gap\.csv: line 6 \(row 4\), column 'gap': "
                                                r"7 but the row's logit_1 - logit_2")
    return cases


@pytest.mark.parametrize("case", ["missing column", "mismatched positions", "non-numeric",
                                  "bad file", "no file", "one run twice", "gap contradicted"])
def test_analyze_main_bad_input_is_one_line(case, tmp_path):
    import re
    paths, pattern = _bad_inputs(tmp_path)[case]
    r = _analyze(paths, str(tmp_path))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("analyze_csv.py: error: "), r.stderr
    assert re.search(pattern, lines[0]), lines[0]


def test_analyze_main_accepts_hand_written_pair(tmp_path):
    paths, _ = _hand_pair(tmp_path, np.random.default_rng(3), n=40)
    r = _analyze(paths, str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "analysis.json").is_file()
    assert (tmp_path / "out" / "phase_differences.png").stat().st_size > 1000


@pytest.mark.parametrize("model,pattern", [
    ("no-such-model", r"model 'no-such-model': .*neither a model name"),
    ("{bad}", r"bad\.gguf is a .*GGUF"),
    ("{mesh}", r"config\.mesh asks for data=1 x model=64 devices; this process has 1"),
])
def test_dump_main_bad_model_is_one_line(model, pattern, tmp_path):
    import re
    extra = []
    if model == "{bad}":
        model = str(tmp_path / "bad.gguf")
        pathlib.Path(model).write_bytes(b"GGUF" + b"\x00" * 64)
    if model == "{mesh}":  # more devices than there are: refused before loading
        model, extra = "smollm2-135m-instruct", ["--config.mesh.model=64"]
    r = _main("dump_logits.py", f"--config={ROOT}/configs/dump_logits.py:tiny",
              f"--config.model={model}", f"--config.output={tmp_path}/x.csv",
              "--config.compilation_cache=False", *extra, cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dump_logits.py: error: "), r.stderr
    assert re.search(pattern, lines[0]), lines[0]
