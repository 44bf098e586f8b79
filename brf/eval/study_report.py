"""The study's report in words, Markdown and plots (``report.json`` / ``report.md``).

:func:`verdicts` states every answer in a sentence from the numbers alone;
:func:`markdown` gathers them with the per-corpus comparison table; :func:`plots`
draws the pooled comparison and the gain by entropy. Each analysis also has its
own full report in its run directory (:mod:`brf.eval.report`).
"""

from __future__ import annotations

import os

import numpy as np

from brf.eval import report as report_lib
from brf.eval.caches import write_json

# Version 3: the ``bytes`` section (the study on every byte, when the plan runs it)
# and the "every byte" verdict; otherwise as version 2.
STUDY_SCHEMA = "brf.study/3"


def provenance(path: str | None = None) -> dict:
    """The code a report was made by: brf's git commit and whether its working tree was
    clean (no tracked file changed, no untracked file outside what git ignores); both
    None where brf does not run from a git checkout (an installed copy)."""
    import subprocess
    root = path or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        clean = git("status", "--porcelain", "--untracked-files=normal") == ""
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "clean": None}
    return {"commit": commit, "clean": clean}


def write(out_dir: str, rep: dict) -> None:
    """report.json, report.md and the plots of the study."""
    write_json(os.path.join(out_dir, "report.json"), rep, indent=1)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(rep))
    plots(out_dir, rep)


def brief(rep: dict | None) -> dict | None:
    """An analysis without its per-method parameters (the per-corpus files keep them)
    or its stability check's record (but for the check's answers); None for None (a
    multi-process run's other processes analyse nothing)."""
    if rep is None:
        return None
    keep = ("analysis", "level", "members", "top_k", "coverage", "split", "nll_comparison",
            "fair_summary", "phase_coherence", "cross_term", "verdict")
    out = {k: rep[k] for k in keep if k in rep}
    out["methods"] = [{"label": m["label"], "variant": m["variant"],
                       "test_nll": m["test"]["nll"], "test_nll_ci": m["test"]["nll_ci"],
                       "calib_nll": m["calib_nll"]} for m in rep["methods"]]
    if "forking" in rep:
        # Keep the gated methods' rows whole (gains, CIs, top share): the study's
        # plot and markdown read them as the per-corpus report has them.
        # The rows tied with a gated row (brf.eval.analysis.TIE_MARGIN) and the gains over
        # tied reference members too: the verdict is stated for each of them.
        keep = ("reference", "top_fraction", "gated", "reference_tied",
                "reference_alternatives")
        out["forking"] = {v: {k: f[k] for k in keep if k in f}
                          | {"by_method": {m: f["by_method"][m] for g in f["gated"].values()
                                           for m in [g["method"], *g.get("tied", [])]}}
                          for v, f in rep["forking"].items()}
    if rep.get("stability"):
        # each verdict as the stability check answered it from the refitted rows: beside
        # the run's answer wherever verdicts are compared (brf.eval.compare.answers)
        out["refit_answers"] = {k: x["refit"] for k, x in rep["stability"]["answers"].items()}
    return out


# ----------------------------------------------------------------- words

def _side(ci, what_low, what_high, what_none):
    return what_low if ci[1] < 0 else what_high if ci[0] > 0 else what_none


def _alternatives_words(entry: dict, ci_of, words) -> str:
    """'' when ``entry`` has no ``alternatives`` (other choices among rows tied on
    calibration, brf.eval.analysis.TIE_MARGIN); else whether each gives the same side of
    0 as the entry, naming those that do not (``words(alternative)``)."""
    alts = entry.get("alternatives") or []
    if not alts:
        return ""
    where = lambda ci: "lower" if ci[1] < 0 else "higher" if ci[0] > 0 else "undecided"
    differ = [a for a in alts if where(ci_of(a)) != where(ci_of(entry))]
    if not differ:
        return (f" The {len(alts)} other choice(s) among rows tied on calibration "
                f"({report_lib.TIE_WORDS}) give the same answer: it stands.")
    return (f" FRAGILE: {len(differ)} of {len(alts)} other choices among rows tied on "
            f"calibration ({report_lib.TIE_WORDS}) answer otherwise: "
            + "; ".join(words(a) for a in differ) + ".")


def bottleneck_words(b: dict) -> str:
    """The softmax-bottleneck rows (:func:`brf.eval.bottleneck_eval.bottleneck_rows`) in
    one paragraph; rows left out (support not above the rank) are named with why."""
    parts = []
    skipped = [r["method"] for r in b["rows"] if "skipped" in r]
    for r in b["rows"]:
        if r["method"].startswith("bottleneck") and "skipped" not in r:
            d = r["difference_to_linear"]
            reg = ", ".join(f"{v} {k}" for k, v in r["regimes"].items() if v)
            parts.append(f"{r['method']} {r['nll']:.3f} (vs the linear pool "
                         f"{d['mean_difference']:+.3f} [{d['ci'][0]:+.3f}, "
                         f"{d['ci'][1]:+.3f}]; regimes: {reg}; fell back to the linear "
                         f"pool at {100 * r['fallback_fraction']:.0f}% of positions)")
    lin = next(r for r in b["rows"] if r["method"] == "linear")
    return (f"One model under two prefixes, {b['positions']} sampled test positions, full "
            f"distributions (bottleneck support: each member's top {b['top_k']} tokens): "
            f"linear pool NLL {lin['nll']:.3f}; " + "; ".join(parts) + "."
            + (f" Not solved: {', '.join(skipped)} (the support is not above the "
               f"constraints' rank, at most {b['rank_bound']}, where they can only fall "
               "back)." if skipped else ""))


def verdicts(rep: dict, unit: str = "position") -> dict[str, str]:
    """The study's answers, one paragraph each, from the numbers alone (differences in
    nats per ``unit``: 'position' on co-aligned positions, 'byte' on every byte)."""
    out = {}
    for label, r in rep["per_corpus"].items():
        out[f"nll: {label}"] = r["verdict"]["nll"]
        if "fair_summary" in r["verdict"]:
            out[f"fair: {label}"] = r["verdict"]["fair_summary"]
    rivals = "the best of every other row" + (
        " (controls included)" if rep.get("config", {}).get("controls", True) else "")
    for key, what in (("pooled", "the best baseline"), ("pooled_fair", rivals)):
        for v, p in rep.get(key, {}).items():
            lo, hi = p["ci"]
            out[f"{'nll' if key == 'pooled' else 'fair'}: pooled ({v})"] = (
                f"Pooled over {len(p['corpora'])} corpora (equal weight each), the best BRF "
                f"setting minus {what}, {report_lib.VARIANT_WORDS.get(v, v)}: "
                f"{p['mean_difference']:+.4f} nats/{unit}, 95% CI [{lo:+.4f}, {hi:+.4f}]: "
                "BRF is " + _side(p["ci"], "better", "worse", "not distinguishable from it")
                + " on this evidence." + _alternatives_words(
                    p, lambda a: a["ci"], lambda a: "; ".join(
                        f"{c}: {b} vs {o}" for c, b, o in a["pairs"]) + " "
                    + f"{a['mean_difference']:+.4f} [{a['ci'][0]:+.4f}, {a['ci'][1]:+.4f}]"))
    for label, pr in rep["prompts"].items():
        e = pr["effect"]
        parts = []
        for r in e["phase_concentration"]:
            parts.append(f"{r['phase_map']}: R̄ {r['rbar_plain']:.3f} -> {r['rbar_prefix']:.3f} "
                         f"(change {r['rbar_change']:+.3f} [{r['rbar_change_ci'][0]:+.3f}, "
                         f"{r['rbar_change_ci'][1]:+.3f}]; excess over the null "
                         f"{r['excess_change']:+.3f})")
        ct = e["cross_term"]
        gap = "; ".join(
            f"{v}: BRF's NLL gap to the best baseline {g['gap_plain']:+.4f} -> "
            f"{g['gap_prefix']:+.4f} (change {g['change']:+.4f} [{g['ci'][0]:+.4f}, "
            f"{g['ci'][1]:+.4f}])" for v, g in e["nll_gap"].items())
        tightened = [r for r in e["phase_concentration"] if r["rbar_change_ci"][0] > 0]
        loosened = [r for r in e["phase_concentration"] if r["rbar_change_ci"][1] < 0]
        gap_ties = "".join(_alternatives_words(
            g, lambda a: a["ci"], lambda a: f"{a['brf_plain']} - {a['baseline_plain']} -> "
            f"{a['brf_prefix']} - {a['baseline_prefix']}: {a['change']:+.4f} "
            f"[{a['ci'][0]:+.4f}, {a['ci'][1]:+.4f}]") for g in e["nll_gap"].values())
        out[f"prompts: {label}"] = (
            f"With the steadying prefix {pr['prefix']!r} on each member, the members' phase "
            f"relationship tightened for {len(tightened)} and loosened for {len(loosened)} "
            f"of {len(e['phase_concentration'])} phase maps (CIs excluding 0) -- "
            + "; ".join(parts) + f". Cross-term AUROC {ct['auroc_plain']:.3f} -> "
            f"{ct['auroc_prefix']:.3f} (change {ct['auroc_change']:+.3f} "
            f"[{ct['auroc_change_ci'][0]:+.3f}, {ct['auroc_change_ci'][1]:+.3f}])."
            + _alternatives_words(ct, lambda a: a["auroc_change_ci"], lambda a: (
                f"{a['setting_plain']} -> {a['setting_prefix']}: {a['auroc_change']:+.3f} "
                f"[{a['auroc_change_ci'][0]:+.3f}, {a['auroc_change_ci'][1]:+.3f}]"))
            + f" {gap}." + gap_ties)
        if pr.get("bottleneck"):
            out[f"softmax bottleneck: {label}"] = bottleneck_words(pr["bottleneck"])
        for key, what in (("same_model", "One model under two prefixes"),
                          ("swarm", "The four-member swarm")):
            if key in pr:
                out[f"{key}: {label}"] = f"{what}: " + " ".join(
                    pr[key]["verdict"][k] for k in ("nll", "fair_summary")
                    if k in pr[key]["verdict"])
    stab = rep.get("stability")
    if stab:
        out["stability"] = stability_words(stab)
        study = stab.get("study") or {}
        for key in [k for k in stab["moved"] if k in study]:  # study-level, moved: say so
            where = key.split(": ")
            name = (f"{where[1].split(' [')[0]}: pooled ({where[1].split(' [')[1][:-1]})"
                    if where[0] == "pooled" else f"prompts: {where[1]}")
            if name in out:
                out[name] += report_lib.refit_words(stab, key, study)
    s = rep.get("topk_sensitivity")
    if s:
        out["event space"] = (
            f"On {s['corpus']}, building the event space from each member's top-"
            f"{s['top_k'][1]} strings instead of top-{s['top_k'][0]}: "
            + ("no verdict moves." if not s["moved"] else
               f"these verdicts move: {', '.join(s['moved'])}."))
    return out


def stability_words(s: dict) -> str:
    """The level's stability check (:mod:`brf.eval.stability`) in one paragraph."""
    top = s.get("largest_row_move")
    largest = (f"the largest move of a row's calibration NLL {top['move']:+.2g} nats "
               f"({top['analysis']}: {top['label']})" if top else "no row moved")
    moved = s["moved"]
    left = s.get("not_refitted") or 0
    which = ("Every calibrated row" if not left else
             "Every calibrated row that a verdict could choose")
    return (f"{which} of the {s['analyses']} analyses was fitted again under "
            f"the perturbation {s['perturbation']!r} (the last bits of the objective "
            f"changed; brf/eval/stability.py): {s['refitted_rows']} rows"
            + (f" ({left} more than the check's reach above every choice were not)"
               if left else "") + ", "
            f"{s['rows_over_tolerance']} of them moved by more than {s['tolerance']:g} "
            f"nats, {largest}. {len(moved)} of {s['verdicts']} verdicts resting on them "
            f"moved" + (f": {'; '.join(moved)}. Each is reported fragile, the refit's "
                        f"answer beside the run's (the fits could as well have stopped at "
                        f"either end); tied rows had already warned of "
                        f"{len(moved) - len(s['moved_untied'])} of them." if moved else "."))


def moved_sentence(moved: dict) -> str:
    """Which verdicts move from co-aligned positions to every byte, in one sentence
    (:func:`brf.eval.compare.level_moves`)."""
    rows = moved["rows"]
    if not moved["moved"]:
        return (f"On every byte, none of the {len(rows)} verdicts compared moves from its "
                f"answer on co-aligned positions.")
    return (f"On every byte, {len(moved['moved'])} of the {len(rows)} verdicts compared "
            f"move from their answer on co-aligned positions: " + "; ".join(
                f"{k} ({rows[k]['tokens']} -> {rows[k]['bytes']})" for k in moved["moved"])
            + ".")


def precision_sentence(p: dict) -> str:
    """The byte level's measured precision and the verdicts it could change, in one
    paragraph (:mod:`brf.eval.byte_precision`)."""
    s, r = p["settings"], p["reference"]
    members = [m for c in p["per_corpus"].values() for m in c["members"].values()]
    shifts = {f"{label}: {k}": v for label, c in p["per_corpus"].items()
              for k, v in c["verdicts"].items()}
    shifts.update({f"pooled: {k}": v for k, v in p.get("pooled", {}).items()})
    weak = [k for k, v in shifts.items() if not v["holds"]]
    return (f"Each member's byte-level view at the study's settings (beam {s['beam']}, "
            f"threshold {s['threshold']:g}, merge lag {s['max_lag']}) against the "
            f"reference (beam {r['beam']}, threshold {r['threshold']:g}, no merging) on "
            f"the first {p['slice_bytes']} bytes of each corpus's first test segment: bits "
            f"per byte within {max(abs(m['dbpb']) for m in members):.2g}, per-byte total "
            f"variation {max(m['tv_mean'] for m in members):.2g} on average and "
            f"{max(m['tv_p99'] for m in members):.2g} at the 99th percentile at worst "
            f"(member and corpus). Moving each byte-level comparison by the shift that "
            f"approximation gives it on the slice, {len(shifts) - len(weak)} of "
            f"{len(shifts)} verdicts hold" + (f"; these could change: {', '.join(weak)}."
                                             if weak else "."))


def _made_by(code: dict | None) -> str:
    """The line naming the commit a report was made at."""
    if not code or not code.get("commit"):
        return "Made by brf outside a git checkout (no commit recorded)."
    state = "a clean tree" if code.get("clean") else "a tree with uncommitted changes"
    return f"Made at brf commit `{code['commit'][:12]}` ({state})."


def markdown(rep: dict) -> str:
    lines = ["# Born Rule Fusion: the study", "",
             "Each corpus has its full report (every method, the tests, the sweep, "
             "forking tokens, plots) in its own directory; this page gathers the verdicts.",
             "", _made_by(rep.get("code")), "", "## Corpora", "",
             "| corpus | source | licence | characters | co-aligned positions | prefix |",
             "|---|---|---|---|---|---|"]
    for c in rep["corpora"]:
        pc = rep["per_corpus"][c["label"]]
        lines.append(f"| {c['label']} | {c['source']} | {c['licence']} | {c['chars']} | "
                     f"{pc['coverage']['positions']} | {c['prefix']!r} |")
    lines += ["", "## Verdicts", ""]
    for k, v in rep["verdict"].items():
        lines.append(f"- **{k}**: {v}")
    lines += ["", "## Best BRF vs best baseline, per corpus and pooled", "",
              "| corpus | variant | BRF | baseline | difference [95% CI] |",
              "|---|---|---|---|---|"]
    for label, r in rep["per_corpus"].items():
        for v, c in r["nll_comparison"].items():
            lines.append(f"| {label} | {v} | {c['brf']} | {c['baseline']} | "
                         f"{c['mean_difference']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] |")
    for v, p in rep["pooled"].items():
        lines.append(f"| **pooled** | {v} | | | {p['mean_difference']:+.4f} "
                     f"[{p['ci'][0]:+.4f}, {p['ci'][1]:+.4f}] |")
    controls = rep.get("config", {}).get("controls", True)
    lines += ["", "## Fair summary: best BRF vs best of every other row" + (
              " (controls included)" if controls else " (no controls: config.controls=False)"),
              "", "| analysis | variant | BRF (k) | other (role, k) | difference [95% CI] |",
              "|---|---|---|---|---|"]
    fair = [(label, r) for label, r in rep["per_corpus"].items()]
    fair += [(f"{label} / {key}", pr[key]) for label, pr in rep["prompts"].items()
             for key in ("with_prefix", "same_model", "swarm") if key in pr]
    if rep.get("topk_sensitivity"):
        s = rep["topk_sensitivity"]
        fair.append((f"{s['corpus']} / top-{s['top_k'][1]} events", s["report"]))
    for label, r in fair:
        for v, c in r.get("fair_summary", {}).items():
            b, o = c["brf"], c["rival"]
            lines.append(f"| {label} | {v} | {b['label']} ({b['free_parameters']}) | "
                         f"{o['label']} ({o['role']}, {o['free_parameters']}) | "
                         f"{c['mean_difference']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] |")
    for v, p in rep.get("pooled_fair", {}).items():
        lines.append(f"| **pooled** | {v} | | | {p['mean_difference']:+.4f} "
                     f"[{p['ci'][0]:+.4f}, {p['ci'][1]:+.4f}] |")
    if controls:
        lines += ["", "Each analysis's report lists the per-token BRF row against each of its "
                  "controls (phases shuffled, reshaping + pool, per-member power mean).", ""]
    lines += ["", "## Forking tokens", ""]
    lines += _forking_lines(rep["per_corpus"], "top {}% entropy positions")
    lines += ["", "Plots: `gain_by_entropy.png` (this directory and each corpus's), "
              "`pooled.png`.", ""]
    if rep.get("bytes"):
        lines += bytes_markdown(rep)
    return "\n".join(lines)


def _forking_lines(per_corpus: dict, top: str) -> list[str]:
    """One line per corpus, variant and gated method of the forking summary; ``top``
    names the high-entropy rows (a format string taking their percentage)."""
    lines = []
    for label, r in per_corpus.items():
        for v, f in r.get("forking", {}).items():
            for g in f["gated"].values():
                share = f["by_method"][g["method"]]["top_share"]
                rows = top.format(f"{100 * f['top_fraction']:.0f}")
                lines.append(
                    f"- {label} [{v}] {g['method']}: {rows} "
                    f"carry {100 * share:.0f}% of the gain over "
                    f"{f['reference']}; gated fusion keeps {100 * g['kept']:.0f}% of it and "
                    f"saves {100 * g['calls_saved']:.0f}% of member calls.")
    return lines


def bytes_markdown(rep: dict) -> list[str]:
    """The study on every byte: coverage, each member's consistency, the byte-level
    verdicts, the per-corpus comparison beside the co-aligned one, and which verdicts
    moved."""
    b = rep["bytes"]
    lines = ["## Every byte", "",
             "The same analyses on every byte of " +
             (f"each corpus's first segments up to {b['max_chars']:,} characters (the "
              f"byte level's span, config.bytes.max_chars; the co-aligned positions "
              f"above cover each whole corpus, so a verdict that moves between the levels "
              f"moved with the text as well as the level)" if b.get("max_chars") else
              "every corpus") +
             f": each member's distribution "
             f"over the 257 byte events (256 bytes, end of text) at each byte, from all its "
             f"tokenizations covering the text (beam {b['beam']}, prune threshold "
             f"{b['threshold']:g}, merge lag {b['max_lag']}); NLL in nats per byte. Each "
             f"corpus's byte-level reports are in its `bytes/` subdirectory." +
             ("" if b.get("prompts", True) else
              " The prompt study is analysed on co-aligned positions only "
              "(config.bytes.prompts was off).") +
             ("" if b.get("swarm", True) or not b.get("prompts", True) else
              " The swarm is analysed on co-aligned positions only (config.bytes.swarm "
              "was off)."), "",
             "### Coverage and consistency", "",
             "Every byte is a row. Pruning drops hypotheses (the canonical tokenization "
             "never): 'pruned' is the mean fraction of the prefix mass dropped per byte, "
             "'dropped' the log-mass dropped (bits per byte: the byte-level NLL lies at most "
             "this far below the exact one; how far above it may lie is not bounded). "
             "'merged' is the mean fraction of "
             "the prefix mass merged into the canonical hypothesis per byte (hypotheses "
             "more than the merge lag behind it: their mass is kept, their own future "
             "is approximated by the canonical one's). 'byte' and 'canonical' are the "
             "member's bits per byte over every byte and of its canonical tokenization "
             "alone; 'non-canonical' is their difference, the mass of the other "
             "tokenizations.", "",
             "| corpus | member | bytes | coverage | pruned | dropped (bits/B) | merged "
             "| byte (bits/B) | canonical (bits/B) | non-canonical (bits/B) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in b["per_corpus"].items():
        cov = r["coverage"]
        for name, c in b.get("consistency", {}).get(label, {}).items():
            lines.append(f"| {label} | {name} | {c['bytes']} | "
                         f"{100 * cov['fraction_of_bytes']:.1f}% | {c['pruned_mean']:.2e} | "
                         f"{c['lost']:.2e} | {c['merged_mean']:.2e} | {c['byte']:.4f} | "
                         f"{c['canonical']:.4f} | {c['noncanonical']:+.4f} |")
    if b.get("precision"):
        lines += precision_markdown(b["precision"])
    lines += ["", "### Verdicts on every byte", ""]
    for k, v in b.get("verdict", {}).items():
        lines.append(f"- **{k}**: {v}")
    lines += ["", "### Best BRF vs best baseline: co-aligned positions and every byte", "",
              "| corpus | variant | co-aligned (nats/position) [95% CI] | every byte "
              "(nats/byte) [95% CI] |", "|---|---|---|---|"]

    def ci(c):
        return f"{c['mean_difference']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}]" if c else ""

    for label, r in b["per_corpus"].items():
        tok = rep["per_corpus"].get(label, {}).get("nll_comparison", {})
        for v, c in r["nll_comparison"].items():
            lines.append(f"| {label} | {v} | {ci(tok.get(v))} | {ci(c)} |")
    for v, p in b.get("pooled", {}).items():
        lines.append(f"| **pooled** | {v} | {ci(rep['pooled'].get(v))} | {ci(p)} |")
    lines += ["", "### Forking bytes", ""]
    lines += _forking_lines(b["per_corpus"], "the top {}% entropy bytes")
    moved = b.get("moved")
    if moved:
        lines += ["", "### Which verdicts moved", "",
                  "Each verdict's answer on co-aligned positions and on every byte (where "
                  "its 95% CI lies, or the count it rests on); the numbers are in each "
                  "level's units, so compare signs, not sizes.", "",
                  "| verdict | co-aligned | every byte | moved |", "|---|---|---|---|"]
        for k, r in moved["rows"].items():
            lines.append(f"| {k} | {r['tokens']} ({r['tokens_value']:+.4g}) | {r['bytes']} "
                         f"({r['bytes_value']:+.4g}) | {'**yes**' if r['moved'] else 'no'} |")
    lines += ["", "Plots: `pooled_bytes.png`, `gain_by_entropy_bytes.png` (this directory), "
              "each corpus's `bytes/`.", ""]
    return lines


def precision_markdown(p: dict) -> list[str]:
    """The precision check's tables: each member against the reference, and each
    byte-level verdict against the shift the approximation gives it."""
    s, r = p["settings"], p["reference"]
    lines = ["", "### Precision of the members' byte-level views", "",
             f"Each member of the default pair rescored the first {p['slice_bytes']} bytes "
             f"of each corpus's first test segment with the reference settings (beam "
             f"{r['beam']}, threshold {r['threshold']:g}, no merging); the study's settings "
             f"(beam {s['beam']}, threshold {s['threshold']:g}, merge lag {s['max_lag']}) "
             "against them: the difference in bits per byte and each byte's total variation "
             "between the two next-byte distributions. The reference is itself pruned (far "
             "less), so these are distances from it, not from the exact distributions."
             + (" 'merging alone': the study's settings against the same without merging."
                if s["max_lag"] else ""), "",
             "| corpus | member | bytes | Δ bits/byte | TV mean | TV p99 | TV max | "
             "bytes with TV > 5% |" + (" merging alone: Δ bits/byte, TV mean |"
                                       if s["max_lag"] else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if s["max_lag"] else "")]
    for label, c in p["per_corpus"].items():
        for name, m in c["members"].items():
            row = (f"| {label} | {name} | {m['bytes']} | {m['dbpb']:+.2e} | {m['tv_mean']:.2e} "
                   f"| {m['tv_p99']:.2e} | {m['tv_max']:.2e} | {m['over_5e2']} |")
            if "merging" in m:
                row += f" {m['merging']['dbpb']:+.2e}, {m['merging']['tv_mean']:.2e} |"
            lines.append(row)
    lines += ["", "### The byte-level verdicts against the approximation", "",
              "Each comparison's fitted rows evaluated on the slice with the members' views "
              "at the study's settings and at the reference: the shift is the change in "
              "their mean paired difference (reference minus study, nats/byte). A verdict "
              "holds when its 95% CI moved by |shift| either way lies where it lay.", "",
              "| where | verdict | difference [95% CI] | shift | holds |", "|---|---|---|---|---|"]
    rows = [(label, k, v) for label, c in p["per_corpus"].items()
            for k, v in c["verdicts"].items()]
    rows += [("pooled", k, v) for k, v in p.get("pooled", {}).items()]
    for where, k, v in rows:
        lines.append(f"| {where} | {k} | {v['difference']:+.4f} [{v['ci'][0]:+.4f}, "
                     f"{v['ci'][1]:+.4f}] | {v['shift']:+.5f} | "
                     f"{'yes' if v['holds'] else '**no**'} |")
    return lines


def plots(out_dir: str, rep: dict) -> list[str]:
    """pooled.png and gain_by_entropy.png; with a byte level also pooled_bytes.png and
    gain_by_entropy_bytes.png."""
    paths = _level_plots(out_dir, rep, "", "position")
    if rep.get("bytes"):
        paths += _level_plots(out_dir, rep["bytes"], "_bytes", "byte")
    return paths


def _level_plots(out_dir: str, rep: dict, suffix: str, unit: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    rows = [(label, v, c) for label, r in rep["per_corpus"].items()
            for v, c in r["nll_comparison"].items()]
    rows += [("pooled", v, p) for v, p in rep["pooled"].items()]
    if not rows:
        return paths
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.2))
    y = np.arange(len(rows))
    m = np.array([r[2]["mean_difference"] for r in rows])
    ci = np.array([r[2]["ci"] for r in rows])
    ax.errorbar(m, y, xerr=[m - ci[:, 0], ci[:, 1] - m], fmt="o", capsize=3)
    ax.axvline(0, color="grey", lw=0.7)
    ax.set_yticks(y, [f"{a} [{b}]" for a, b, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"best BRF minus best baseline, test NLL (nats/{unit}); < 0: BRF better")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"pooled{suffix}.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    first = next(iter(rep["per_corpus"].values()))
    if first.get("forking"):
        paths.append(report_lib.plot_gain_by_entropy(
            os.path.join(out_dir, f"gain_by_entropy{suffix}.png"), first["forking"], unit=unit))
    return paths
