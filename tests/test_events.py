"""The co-aligned event table (brf.eval.events) against a float64 reference built from
the members' full next-token distributions."""

import numpy as np
import pytest

from brf.eval.events import OTHER, build_event_table
from brf.eval.fitting import Fitted, evaluate
from brf.eval.scoring import MemberScores

LETTERS = [bytes([c]) for c in b"abcdefgh"]
# Member A: the eight letters; member B: the letters in another order and two strings
# only B can express as one token.
VOCABS = [LETTERS, LETTERS[::-1] + [b"xy", b"zz"]]
TOP_K = 3


def _member(vocab, text, logp_RxV):
    """MemberScores of one segment from full next-token log-probs (one row per token
    after the first)."""
    ids = np.array([vocab.index(bytes([c])) for c in text])
    order = np.argsort(-logp_RxV, axis=1)[:, :TOP_K]
    top = np.take_along_axis(logp_RxV, order, 1)
    rows = len(ids) - 1
    return MemberScores(ids, np.array([0, len(ids)]), np.array([0, rows]), order,
                        top.astype(np.float32),
                        logp_RxV[np.arange(rows), ids[1:]].astype(np.float32),
                        np.zeros(rows, np.float32), (top[:, 0] - top[:, 1]).astype(np.float32),
                        np.zeros(rows, np.float32), len(vocab))


def _case(seed=0, n=60):
    rng = np.random.default_rng(seed)
    text = bytes(rng.choice(list(b"abcdefgh"), n).tolist())
    full = []
    for vocab in VOCABS:
        x = rng.normal(0, 2.0, (n - 1, len(vocab)))
        full.append(x - np.log(np.exp(x).sum(1, keepdims=True)))
    scores = [_member(v, text, f) for v, f in zip(VOCABS, full)]
    return text, full, scores


def _reference(vocabs, full_NxV, gold: bytes):
    """One position by the module's rules, in float64: (events, [n, E+1] probs with
    OTHER last, gold column, gold offset)."""
    tops = [{vocab[t]: p[t] for t in np.argsort(-p)[:TOP_K]}
            for vocab, p in zip(vocabs, [np.exp(f) for f in full_NxV])]
    events = []
    for top in tops:
        events += [s for s in top if s not in events]
    rows = []
    for vocab, top in zip(vocabs, tops):
        tail = 1.0 - sum(top.values())
        missing = [s for s in events if s not in top and s in vocab]
        share = tail / (len(vocab) - len(top))
        rows.append([top.get(s, share if s in missing else 0.0) for s in events]
                    + [tail - share * len(missing)])
    if gold in events:
        return events, np.array(rows), events.index(gold), 0.0
    p_gold = [np.exp(f[v.index(gold)]) if gold in v else 0.0 for v, f in zip(vocabs, full_NxV)]
    s = np.mean([p / (1.0 - sum(t.values())) for p, t in zip(p_gold, tops)])
    return events, np.array(rows), len(events), np.log(s)


def test_event_table_follows_the_rules_and_leaves_the_gold_out_of_the_events():
    text, full, scores = _case()
    table, cov = build_event_table(scores, [VOCABS[0], VOCABS[1]], [text.decode()])
    assert table.n_positions == cov.positions == len(text) - 1
    unlisted = 0
    for q in range(table.n_positions):
        gold = text[q + 1:q + 2]
        events, probs, col, offset = _reference(VOCABS, [f[q] for f in full], gold)
        e = len(events)
        np.testing.assert_allclose(np.exp(table.logp[q, :, :e + 1].astype(np.float64)), probs,
                                   rtol=2e-5, atol=1e-7)
        assert not np.isfinite(table.logp[q, :, e + 1:]).any()  # nothing but the lists
        assert table.gold[q] == col
        assert table.offset[q] == pytest.approx(offset, abs=1e-5)
        unlisted += col == e
    # The case exercises both kinds of position.
    assert 5 <= unlisted <= table.n_positions - 5
    assert (~table.gold_listed).sum() == unlisted


def test_the_gold_changes_no_event_only_the_offset():
    """Two texts that differ in one unlisted gold give the same rows there: no method
    can find the gold among the events."""
    text, full, scores = _case(seed=1)
    table, _ = build_event_table(scores, [VOCABS[0], VOCABS[1]], [text.decode()])
    q = int(np.flatnonzero(~table.gold_listed)[0])
    gold = text[q + 1]
    listed = {VOCABS[i][t] for i in range(2) for t in scores[i].topk_ids[q]}
    other = next(c for c in b"abcdefgh" if bytes([c]) not in listed and c != gold)
    text2 = text[:q + 1] + bytes([other]) + text[q + 2:]
    scores2 = [_member(v, text2, f) for v, f in zip(VOCABS, full)]
    table2, _ = build_event_table(scores2, [VOCABS[0], VOCABS[1]], [text2.decode()])
    np.testing.assert_array_equal(table.logp[q], table2.logp[q])
    assert table.gold[q] == table2.gold[q]
    assert table.offset[q] != table2.offset[q]


def test_scores_are_proper_over_every_string():
    """The linear pool's probabilities of every string a member can emit, scored as the
    gold under the rules, sum to at most 1 at every position; evaluate() adds the
    offset and gives no top-1 credit to a gold in OTHER."""
    text, full, scores = _case(seed=2, n=30)
    strings = sorted(set(VOCABS[0]) | set(VOCABS[1]))
    for q in range(len(text) - 1):
        total = 0.0
        for g in strings:
            events, probs, col, offset = _reference(VOCABS, [f[q] for f in full], g)
            total += probs[:, col].mean() * np.exp(offset)
        assert total <= 1.0 + 1e-9
    table, _ = build_event_table(scores, [VOCABS[0], VOCABS[1]], [text.decode()])
    ev = evaluate(Fitted("linear", "linear", {}, np.array([0.5, 0.5]), 0.0), table)
    for q in range(table.n_positions):
        events, probs, col, offset = _reference(VOCABS, [f[q] for f in full],
                                                text[q + 1:q + 2])
        assert ev["nll"][q] == pytest.approx(-np.log(probs[:, col].mean()) - offset, rel=1e-4)
    assert (ev["top1_credit"][~table.gold_listed] == 0).all()
    assert OTHER not in VOCABS[1]
