"""One analysis's report: JSON (documented schema), Markdown summary, PNG plots.

JSON schema (``report-<analysis>.json`` in a corpus's run directory), all NLLs in
nats per position of the analysis's event table:

    {
      "schema": "brf.analysis/3",
      "analysis": str, "level": "tokens" | "bytes",
      "top_k": int,                       # tokens only
      "beam": int, "threshold": float,    # bytes only
      "members": [{"name", "vocab_size", "prefix_tokens", "positions"
                   (, "consistency": {...} at the byte level: brf.bytes.scoring.consistency)}],
      "coverage": {"positions", "bytes_total", "fraction_of_bytes",
                   tokens: "member_positions", "bytes_covered",
                   "fraction_of_member_positions";
                   bytes: "pruned_mean", "lost_bits_per_byte" (per member)},
      "split": {"calibration_positions", "test_positions"},
      "methods": [{"label", "method", "variant", "role", "params", "weights",
                   "calib_nll", "fit": {"iterations", "evaluations", "converged"},
                   "test": {"nll", "nll_ci", "perplexity", "bits_per_byte",
                            "top1_accuracy", "ece", "floored_positions"}}],
      "phase_coherence": [{"phase_map", "spec", "pair", "n", "mean_resultant_length",
                           "mean_direction", "rayleigh_z", "rayleigh_p",
                           "permutation_p", "null_mean_resultant_length"}],
      "cross_term": {"setting", "cross": {"auroc", "ci", "p_value", "n_gold",
                     "n_competitors"}, "rel": {...}, "rel_equal_phases": {...}},
      "nll_comparison": {<variant>: {"brf", "baseline", "mean_difference", "ci",
                                     "p_value", "block", "n"}},   # like with like
      "fair_summary": {<variant>: {"brf": ROW, "rival": ROW, "mean_difference", "ci",
                       "p_value", "block", "n", "brf_candidates", "rival_candidates",
                       "per_token": ROW, "controls": [ROW + {"mean_difference", "ci",
                       "p_value", "block", "n"}]}},
          # ROW = {"label", "role", "method", "free_parameters", "calib_nll", "test_nll"};
          # differences are the BRF row minus the other row; "per_token" / "controls"
          # only when the variant has controls
      "forking": {<variant>: {"reference", "primary_member", "top_fraction",
                  "by_method": {<label>: {"mean_gain", "ci", "entropy_edges", "total_gain",
                                "top_fraction", "top_share", "top_mean_gain",
                                "rest_mean_gain"}},
                  "gated": {"brf"|"baseline": {"method", "threshold", "fused_fraction",
                            "gain_full", "gain_gated", "kept", "calls_saved"}}}},
      "sweep": [{"phase_map", "param", "values", "calib_nll", "test_nll"}],
      "verdict": {"phase_coherence", "cross_term", "nll", "forking_tokens" (at the byte
        level "forking_bytes")}
    }

Version 3 (this one): one report per analysis, each method's role and fit
diagnostics (L-BFGS iterations, evaluations, convergence), the fair summary;
``level`` and the byte-level fields were added with the study on every byte
(a report without ``level`` is on co-aligned token positions). At the byte level
a position is a byte: NLLs are in nats per byte, the events are the 257 byte
events.
"""

from __future__ import annotations

import os

import numpy as np

from brf.eval.analysis import controls_answer
from brf.eval.caches import write_json

SCHEMA = "brf.analysis/3"


_UNIT_WORDS = {"byte": "byte", "position": "co-aligned position"}


def unit(report: dict) -> str:
    """What one row of the analysis's event table is: 'byte' or (co-aligned) 'position'."""
    return "byte" if report.get("level") == "bytes" else "position"


def verdicts(report: dict, alpha: float = 0.05) -> dict[str, str]:
    """One plain sentence per test, from the numbers alone."""
    out = {}
    u = unit(report)
    pc = report["phase_coherence"]
    coherent = [r for r in pc if r["permutation_p"] < alpha]
    trivial = [r for r in pc if r["rayleigh_p"] < alpha and r["permutation_p"] >= alpha]
    out["phase_coherence"] = (
        f"{len(coherent)} of {len(pc)} (phase map, pair) tests reject independence of "
        f"the members' phases under the permutation null (p < {alpha}); "
        f"{len(trivial)} reject uniformity under Rayleigh only, i.e. coherence explained "
        f"by the phase map's range, not by a link between members.")
    ct = report["cross_term"]
    lo, hi = ct["rel"]["ci"]
    side = ("separates gold from competitors (CI above 0.5)" if lo > 0.5 else
            "ranks gold below competitors (CI below 0.5)" if hi < 0.5 else
            "does not separate gold from competitors (CI contains 0.5)")
    c_lo, c_hi = ct["rel_equal_phases"]["ci"]
    overlap = not (lo > c_hi or hi < c_lo)
    out["cross_term"] = (
        f"With {ct['setting']}, the relative interference term {side}: AUROC "
        f"{ct['rel']['auroc']:.3f} [{lo:.3f}, {hi:.3f}]; with equal phases (pure member "
        f"agreement, the control) {ct['rel_equal_phases']['auroc']:.3f} "
        f"[{c_lo:.3f}, {c_hi:.3f}] -- "
        + ("the intervals overlap, so the separation is not shown to come from the phases."
           if overlap else
           "the phase map improves the separation beyond member agreement." if lo > c_hi else
           "the phase map separates gold WORSE than member agreement alone.")
        + _cross_ties(ct))
    out["nll"] = " ".join(nll_sentence(c, v, u) for v, c in report["nll_comparison"].items())
    fair = " ".join(fair_sentence(c, v, u) for v, c in report.get("fair_summary", {}).items())
    if fair:
        out["fair_summary"] = fair
    fk = forking_sentence(report.get("forking", {}), u)
    if fk:
        out["forking_bytes" if u == "byte" else "forking_tokens"] = fk
    s = report.get("stability")
    if s:
        out["stability"] = stability_sentence(s)
        # a verdict the check moved says so where it is stated
        forking = "forking_bytes" if u == "byte" else "forking_tokens"
        for key in s["moved"]:
            where = {"nll": "nll", "fair": "fair_summary", "controls": "fair_summary",
                     "cross-term": "cross_term", "forking": forking}.get(key.split(" [")[0])
            if where in out:
                out[where] += refit_words(s, key, s["answers"])
    return out


def refit_words(s: dict, key: str, answers: dict) -> str:
    """' FRAGILE under the stability check ...' where the check (``s``) moved the verdict
    ``key`` (its answers in ``answers``: key -> run's and refit's); '' otherwise."""
    if key not in (s.get("moved") or ()) or key not in answers:
        return ""
    a = answers[key]
    return (f" FRAGILE under the stability check ({key}): refitted, its rows answer "
            f"'{a['refit']}', this run '{a['run']}'.")


def stability_sentence(s: dict) -> str:
    """The stability check of one analysis (:mod:`brf.eval.stability`) in words."""
    top = s.get("largest_row_move")
    largest = (f"the largest move of a row's calibration NLL {top['move']:+.2g} nats "
               f"({top['label']})" if top else "no row moved")
    over = s["rows_over_tolerance"]
    moved = s["moved"]
    return (f"{_refitted_words(s)} under the perturbation {s['perturbation']!r}: "
            f"{largest}; {len(over)} moved by more than "
            f"{s['tolerance']:g}. {len(moved)} of {s['verdicts']} verdicts resting on them "
            f"moved" + (f" ({'; '.join(_moved_words(k, s) for k in moved)}). Each is "
                        f"FRAGILE, the refit's answer beside the run's; tied rows had "
                        f"already warned of {len(moved) - len(s['moved_untied'])} of them."
                        if moved else ".")
            + _unchecked_words(s))


def _moved_words(key: str, s: dict) -> str:
    """A verdict the check moved: 'key: run's answer, refit: its answer'."""
    a = (s.get("answers") or {}).get(key)
    return f"{key}: {a['run']}, refit: {a['refit']}" if a else key


def _unchecked_words(s: dict) -> str:
    """The variants whose rows the check did not refit (their verdicts unchecked)."""
    left = s.get("variants_not_refitted") or []
    if not left:
        return ""
    names = " and ".join("as proposed" if v == "proposed" else v for v in left)
    return (f" The rows {names} were not refitted, so the verdicts resting on them are "
            f"not checked.")


def _refitted_words(s: dict) -> str:
    """Which calibrated rows the stability check refitted, in words."""
    left = s.get("not_refitted") or []
    if not left:
        return f"Every calibrated row refitted ({s['refitted_rows']} rows)"
    return (f"The {s['refitted_rows']} calibrated rows within {s['reach']:.3g} nats of some "
            f"choice refitted ({len(left)} further up not: {', '.join(left)})")


def _cross_ties(ct: dict) -> str:
    """The cross-term test with the BRF rows tied with its setting, when there are any."""
    alts = ct.get("alternatives") or []
    if not alts:
        return ""
    where = lambda rel: _where([x - 0.5 for x in rel["ci"]])
    main = where(ct["rel"])
    parts = [f"{a['setting']} {a['rel']['auroc']:.3f} [{a['rel']['ci'][0]:.3f}, "
             f"{a['rel']['ci'][1]:.3f}]" for a in alts]
    same = all(where(a["rel"]) == main for a in alts)
    return (f" With the BRF rows tied with its setting ({TIE_WORDS}): " + "; ".join(parts)
            + (" -- the verdict stands." if same else " -- FRAGILE: they answer otherwise."))


VARIANT_WORDS = {"proposed": "as proposed (no temperature for either side, except a "
                             "method's own)",
                 "calibrated": "calibrated (every method with a fitted post-fusion "
                               "temperature and per-member temperatures)"}


# How a verdict that rests on rows chosen on calibration is qualified (TIE_MARGIN of
# brf.eval.analysis; kept here as words so that reports need no import of the fitter).
TIE_WORDS = ("within 2e-4 nats on calibration (twice the fits' repeatability goal) "
             "plus how far the stability check saw either row's fit move")
_SIDES = {"lower": "lower", "higher": "higher", "undecided": "not distinguishable"}


def _where(ci) -> str:
    return "lower" if ci[1] < 0 else "higher" if ci[0] > 0 else "undecided"


def ties_sentence(c: dict, names: tuple[str, str], other_key: str) -> str:
    """'' when no other row is tied with a comparison's chosen rows; else which rows are
    ({TIE_WORDS}) and whether the answer stands for every pair of them, with the
    differences that disagree (a *fragile* verdict)."""
    tied = c.get("tied") or {}
    alts = c.get("alternatives") or []
    if not alts:
        return ""
    named = "; ".join(f"{what} {', '.join(tied[key])}" for key, what in
                      zip(names, ("BRF rows", "other rows")) if len(tied.get(key, [])) > 1)
    main = _where(c["ci"])
    differ = [a for a in alts if _where(a["ci"]) != main]
    if not differ:
        return (f" Rows tied with the chosen ones ({TIE_WORDS}): {named}; every pair gives "
                f"the same answer: the verdict stands.")
    parts = [f"{a['brf']} vs {a[other_key]} {a['mean_difference']:+.4f} [{a['ci'][0]:+.4f}, "
             f"{a['ci'][1]:+.4f}] ({_SIDES[_where(a['ci'])]})" for a in differ]
    return (f" FRAGILE: rows tied with the chosen ones ({TIE_WORDS}): {named}; "
            f"{len(differ)} of {len(alts)} other pairs give another answer: "
            + "; ".join(parts) + ".")


def nll_sentence(c: dict, variant: str, unit: str = "position") -> str:
    """One sentence: best BRF vs best baseline of one variant, with the CI (and the rows
    tied with the chosen ones, :func:`ties_sentence`)."""
    lo, hi = c["ci"]
    if hi < 0:
        what = f"{c['brf']} has LOWER test NLL than the best baseline {c['baseline']}"
    elif lo > 0:
        what = f"{c['brf']} has HIGHER test NLL than the best baseline {c['baseline']}"
    else:
        what = (f"{c['brf']} and the best baseline {c['baseline']} are not "
                f"distinguishable in test NLL" + (" (fit)" if fit_undecided(c) else ""))
    return (f"Comparing methods {VARIANT_WORDS.get(variant, variant)}: {what}: mean "
            f"difference {c['mean_difference']:+.4f} nats/{unit}, 95% CI "
            f"[{lo:+.4f}, {hi:+.4f}] (paired block bootstrap{spread_words(c)})."
            + ties_sentence(c, ("brf", "baseline"), "baseline"))


def fit_undecided(c: dict) -> bool:
    """Whether a difference's bootstrap interval alone clears 0 but not once widened by
    the two rows' fit spreads: 'not distinguishable (fit)'."""
    raw = c.get("statistical_ci")
    return raw is not None and _where(raw) != "undecided" and _where(c["ci"]) == "undecided"


def spread_words(c: dict) -> str:
    """', widened by the fit spread s' where the rows' fit spreads widen the CI."""
    s = c.get("fit_spread") or 0.0
    return f", widened by the rows' fit spread {s:.4f}" if s > 0 else ""


def _ci(c: dict) -> str:
    return f"{c['mean_difference']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}]"


def fair_sentence(c: dict, variant: str, unit: str = "position") -> str:
    """The fair summary of one variant in words: the best BRF row against the best of
    every other row, and the per-token BRF row against its controls."""
    b, r = c["brf"], c["rival"]
    lo, hi = c["ci"]
    edge = ("BRF's edge survives" if hi < 0 else "BRF is WORSE" if lo > 0 else
            "no edge either way is shown" + (" (not distinguishable (fit): the bootstrap "
                                              "interval alone clears 0, the rows' fit "
                                              "spread does not)" if fit_undecided(c) else ""))
    out = (f"[{variant}] Best BRF row {b['label']} ({b['free_parameters']} free parameters; "
           f"best of {c['brf_candidates']} BRF rows on calibration) minus the best of the "
           f"{c['rival_candidates']} other rows, {r['label']} ({r['role']}, "
           f"{r['free_parameters']} free parameters): {_ci(c)} nats/{unit}: {edge}."
           + ties_sentence(c, ("brf", "rival"), "rival"))
    if c.get("per_token") is not None and not c.get("controls"):
        out += (f" The per-token BRF row {c['per_token']['label']}: controls not fitted "
                f"(it was not tied with the row they were fitted for).")
    elif c.get("controls"):
        t = c["per_token"]
        parts = [f"{x['label']} ({x['free_parameters']}) {_ci(x)}" for x in c["controls"]]
        shuffled = [x for x in c["controls"] if x["method"] == "born_shuffled"]
        beaten = [x for x in c["controls"] if x["ci"][1] < 0]
        if shuffled and shuffled[0]["ci"][1] < 0:
            why = "the phases' link to tokens carries part of its fit (shuffling them costs)"
        elif shuffled:
            why = ("shuffling its phases across tokens costs nothing detectable, so its fit "
                   "is not shown to come from the interference structure")
        else:
            why = ""
        out += (f" The per-token BRF row {t['label']} ({t['free_parameters']}) minus each "
                f"control: " + "; ".join(parts) + f" -- it beats {len(beaten)} of "
                f"{len(c['controls'])} controls" + (f"; {why}." if why else "."))
        alts = c.get("per_token_alternatives") or []
        done = {t["label"]} | {a["per_token"]["label"] for a in alts}
        missing = [label for label in c.get("per_token_tied", []) if label not in done]
        if alts or missing:
            main = controls_answer(c["controls"])
            each = [f"{a['per_token']['label']}: {controls_answer(a['controls'])}"
                    for a in alts] + [f"{label}: controls not fitted" for label in missing]
            stands = not missing and all(controls_answer(a["controls"]) == main for a in alts)
            out += (f" Per-token rows tied with it ({TIE_WORDS}, or a refit could reorder "
                    f"them), each against its own controls: {'; '.join(each)} -- "
                    + ("the verdict stands." if stands else
                       f"FRAGILE (the chosen row: {main})."))
    return out


def fair_markdown(fair: dict, unit: str = "position") -> list[str]:
    """The fair summary as a table: rows with their free-parameter counts, differences
    to the BRF row (< 0: BRF better)."""
    if not fair:
        return []
    lines = ["## Fair summary: BRF against every other row, controls included", "",
             f"Differences are the BRF row's test NLL minus the other row's (nats/{unit}, "
             "paired block bootstrap 95% CI); `k` is the row's count of free parameters "
             "(brf/eval/controls.py).", "",
             "| variant | BRF row (k) | other row (role, k) | difference [95% CI] |",
             "|---|---|---|---|"]
    for v, c in fair.items():
        b, r = c["brf"], c["rival"]
        lines.append(f"| {v} | {b['label']} ({b['free_parameters']}) | best other: "
                     f"{r['label']} ({r['role']}, {r['free_parameters']}) | {_ci(c)} |")
        for x in c.get("controls", []):
            t = c["per_token"]
            lines.append(f"| {v} | {t['label']} ({t['free_parameters']}) | {x['label']} "
                         f"(control, {x['free_parameters']}) | {_ci(x)} |")
    return lines + [""]


def forking_sentence(forking: dict, unit: str = "position") -> str:
    """What share of the gain the high-entropy positions carry, and what gating keeps."""
    parts = []
    for v, f in forking.items():
        g = f.get("gated", {}).get("brf")
        if not g:
            continue
        share = f["by_method"][g["method"]]["top_share"]
        parts.append(
            f"[{v}] {g['method']}: the top {100 * f['top_fraction']:.0f}% highest-entropy "
            f"positions carry {100 * share:.0f}% of its total gain over the best single "
            f"member ({f['reference']}); fusing only where the primary member's entropy is in "
            f"its top {100 * f['top_fraction']:.0f}% (fused at "
            f"{100 * g['fused_fraction']:.0f}% of test positions) keeps "
            f"{100 * g['kept']:.0f}% of full fusion's gain ({g['gain_gated']:+.4f} vs "
            f"{g['gain_full']:+.4f} nats/{unit}) and saves {100 * g['calls_saved']:.0f}% "
            f"of member calls.")
    return " ".join(parts)


def write_analysis(run_dir: str, name: str, rep: dict, *, corpus: dict,
                   figures: tuple | None = None) -> None:
    """``report-<name>.json`` / ``.md`` in ``run_dir``; with ``figures`` = (coherence
    rows, cross-term scores) also the PNG plots."""
    write_json(os.path.join(run_dir, f"report-{name}.json"), {"schema": SCHEMA, **rep},
               indent=1)
    with open(os.path.join(run_dir, f"report-{name}.md"), "w") as f:
        f.write(markdown({**rep, "corpus": corpus}))
    if figures is not None:
        plots(run_dir, rep, *figures)


def markdown(report: dict) -> str:
    """A summary a reader understands without the code."""
    cov = report["coverage"]
    lines = [
        "# Born Rule Fusion: validation report", "",
        "## What was run", "",
        "- Members: " + ", ".join(f"`{m['name']}` (V={m['vocab_size']})"
                                   for m in report["members"]),
        f"- Corpus: {report['corpus']['source']} ({report['corpus']['chars']} characters, "
        f"{report['corpus']['segments']} segments, sha256 {report['corpus']['sha256'][:12]}…)",
    ] + (_bytes_lines(report) if unit(report) == "byte" else [
        f"- Co-aligned positions (every member at a token boundary and predicting the same "
        f"next string): {cov['positions']} covering {cov['bytes_covered']} of "
        f"{cov['bytes_total']} bytes ({100 * cov['fraction_of_bytes']:.1f}%).",
        f"- Calibration / test split (disjoint, by segment order): "
        f"{report['split']['calibration_positions']} / {report['split']['test_positions']} "
        f"positions. Every method's continuous parameters (weights, temperature, "
        f"power order, phase-map parameters, gates) were fitted on calibration.",
        f"- Events: every member's top-{report.get('top_k', 'k')} next strings and OTHER; the "
        f"gold adds none. At {report['split'].get('test_gold_in_other', 0)} test positions "
        f"no member lists the gold: it is scored as OTHER times its share of the members' "
        f"tails (the same for every method), with no top-1 credit.",
    ]) + [
        "", "## Verdicts", "",
    ]
    for k, v in report["verdict"].items():
        lines.append(f"- **{k.replace('_', ' ')}**: {v}")
    lines += ["", "## Test-split results by method", "",
              "| method | NLL (nats) [95% CI] | perplexity | bits/byte | top-1 acc | ECE | fitted |",
              "|---|---|---|---|---|---|---|"]
    for m in sorted(report["methods"], key=lambda m: m["test"]["nll"]):
        t = m["test"]
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in m["params"].items())
        w = "w=" + "/".join(f"{x:.2f}" for x in m["weights"])
        lines.append(f"| {m['label']} | {t['nll']:.4f} [{t['nll_ci'][0]:.4f}, "
                     f"{t['nll_ci'][1]:.4f}] | {t['perplexity']:.2f} | "
                     f"{t['bits_per_byte']:.4f} | {t['top1_accuracy']:.3f} | {t['ece']:.3f} | "
                     f"{w}; {params} |")
    lines += ["", "## Phase Coherence Test", "",
              "Phase differences between members over the test positions, for each "
              "phase map as configured (maps that ignore the logits are left out). "
              "Rayleigh's test asks whether the differences are uniform on the circle; "
              "the permutation null (positions of one member shuffled) asks whether the "
              "members' phases are linked at all.", "",
              "| phase map | pair | n | R̄ | Rayleigh z | Rayleigh p | permutation p |",
              "|---|---|---|---|---|---|---|"]
    for r in report["phase_coherence"]:
        lines.append(f"| `{r['spec']}` | {r['pair'][0]}-{r['pair'][1]} | {r['n']} | "
                     f"{r['mean_resultant_length']:.4f} | {r['rayleigh_z']:.2f} | "
                     f"{r['rayleigh_p']:.3g} | {r['permutation_p']:.3g} |")
    ct = report["cross_term"]
    lines += ["", "## Cross-Term Discrimination Test", "",
              f"Setting: {ct['setting']}. AUROC of the interference term, gold event vs "
              f"competitor events (bootstrap 95% CI):", "",
              f"- raw cross-term: {ct['cross']['auroc']:.4f} [{ct['cross']['ci'][0]:.4f}, "
              f"{ct['cross']['ci'][1]:.4f}] ({ct['cross']['n_gold']} gold, "
              f"{ct['cross']['n_competitors']} competitors)",
              f"- relative (cross / linear): {ct['rel']['auroc']:.4f} "
              f"[{ct['rel']['ci'][0]:.4f}, {ct['rel']['ci'][1]:.4f}]",
              f"- control, relative term with equal phases (member agreement only): "
              f"{ct['rel_equal_phases']['auroc']:.4f} [{ct['rel_equal_phases']['ci'][0]:.4f}, "
              f"{ct['rel_equal_phases']['ci'][1]:.4f}]", "",
              ""]
    lines += fair_markdown(report.get("fair_summary", {}), unit(report))
    lines += forking_markdown(report.get("forking", {}), unit(report))
    lines += ["Plots: `nll_by_method.png`, `phase_differences.png`, `sweep.png`, "
              "`cross_terms.png`, `gain_by_entropy.png`.", ""]
    return "\n".join(lines)


def _bytes_lines(report: dict) -> list[str]:
    """'What was run' of a byte-level analysis: every byte, the pruning, each member's
    consistency."""
    cov = report["coverage"]
    lines = [
        f"- Every byte: {cov['positions']} rows for the corpus's {cov['bytes_total']} bytes "
        f"({100 * cov['fraction_of_bytes']:.1f}%). Each member's distribution over the 257 "
        f"byte events (256 bytes, end of text) at each byte, from all its tokenizations "
        f"covering the text (beam {report.get('beam')}, prune threshold "
        f"{report.get('threshold')}); NLL in nats per byte.",
        f"- Calibration / test split (disjoint, by segment order): "
        f"{report['split']['calibration_positions']} / {report['split']['test_positions']} "
        f"bytes. Every method's continuous parameters were fitted on calibration.",
        "- Per member: the mean fraction of the prefix mass pruning dropped per byte, the "
        "log-mass it dropped (bits per byte), and bits per byte over every byte against its "
        "canonical tokenization's (the difference is the mass of the other tokenizations):"]
    for i, m in enumerate(report["members"]):
        c = m.get("consistency", {})
        if c:
            lines.append(f"  - `{m['name']}`: pruned {cov['pruned_mean'][i]:.2e}, dropped "
                         f"{cov['lost_bits_per_byte'][i]:.2e} bits/byte; {c['byte']:.4f} "
                         f"bits/byte vs canonical {c['canonical']:.4f} (non-canonical "
                         f"{c['noncanonical']:+.4f}).")
    return lines


def forking_markdown(forking: dict, unit: str = "position") -> list[str]:
    """The forking-token tables: gain over the best single member by entropy decile."""
    lines = []
    for v, f in forking.items():
        lines += [f"## Forking tokens ({v})", "",
                  f"Gain in NLL over the best single member ({f['reference']}) by decile of "
                  f"the members' mean entropy on the test split (D1 = most certain), nats "
                  f"per {unit}; 'top share' = the share of the method's total gain at the "
                  f"top {100 * f['top_fraction']:.0f}% entropy positions.", "",
                  "| method | " + " | ".join(f"D{i + 1}" for i in range(10)) + " | top share |",
                  "|---|" + "---|" * 11]
        for label, g in f["by_method"].items():
            lines.append(f"| {label} | " + " | ".join(f"{x:+.3f}" for x in g["mean_gain"])
                         + f" | {100 * g['top_share']:.0f}% |")
        for kind, g in f.get("gated", {}).items():
            lines.append("")
            lines.append(f"- Entropy-gated {kind} ({g['method']}): fused at "
                         f"{100 * g['fused_fraction']:.0f}% of positions, keeps "
                         f"{100 * g['kept']:.0f}% of the full gain, saves "
                         f"{100 * g['calls_saved']:.0f}% of member calls.")
        lines.append("")
    return lines


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def plots(out_dir: str, report: dict, phase_rows: list[dict], cross_scores: dict) -> list[str]:
    """Writes the PNG plots; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ms = sorted(report["methods"], key=lambda m: m["test"]["nll"])
    paths.append(plot_nll_ci(os.path.join(out_dir, "nll_by_method.png"),
                             [m["label"] for m in ms], [m["test"]["nll"] for m in ms],
                             [m["test"]["nll_ci"] for m in ms],
                             f"test NLL (nats per {_UNIT_WORDS[unit(report)]}), 95% "
                             "block-bootstrap CI"))
    paths.append(plot_phase_differences(os.path.join(out_dir, "phase_differences.png"),
                                        phase_rows))
    # Sweep curves.
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in report["sweep"]:
        ax.plot(s["values"], s["test_nll"], marker=".", label=f"{s['phase_map']} ({s['param']})")
    for m in report["methods"]:
        if m.get("role") == "baseline" and m["variant"] == "proposed":
            ax.axhline(m["test"]["nll"], ls="--", lw=1, color="gray")
            ax.text(ax.get_xlim()[0], m["test"]["nll"], m["label"], fontsize=7, va="bottom")
    ax.set_xlabel("swept parameter value (uniform weights, other parameters at defaults)")
    ax.set_ylabel("test NLL (nats)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "sweep.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    # Cross-term contribution, gold vs competitors.
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, title in ((axes[0], "cross", "raw cross-term"),
                           (axes[1], "rel", "cross-term / linear part")):
        g, c = cross_scores[f"gold_{key}"], cross_scores[f"comp_{key}"]
        lo, hi = np.percentile(np.concatenate([g, c]), [1, 99])
        ax.hist(c, bins=60, range=(lo, hi), density=True, alpha=0.6, label="competitors")
        ax.hist(g, bins=60, range=(lo, hi), density=True, alpha=0.6, label="gold")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "cross_terms.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if report.get("forking"):
        paths.append(plot_gain_by_entropy(os.path.join(out_dir, "gain_by_entropy.png"),
                                          report["forking"], unit=unit(report)))
    return paths


def plot_nll_ci(path: str, labels, nll, ci, xlabel: str, dpi: int = 120) -> str:
    """One row per label: the NLL with its CI as an error bar (shared by the reports)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    nll, ci = np.asarray(nll, np.float64), np.asarray(ci, np.float64).reshape(-1, 2)
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(labels) + 1.2))
    y = np.arange(len(labels))
    ax.errorbar(nll, y, xerr=[nll - ci[:, 0], ci[:, 1] - nll], fmt="o", capsize=3)
    ax.set_yticks(y, list(labels), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_phase_differences(path: str, rows: list[dict]) -> str:
    """A histogram of the phase differences per (phase map, pair) coherence row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    k = max(1, len(rows))
    cols = min(4, k)
    nrows = -(-k // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, rows):
        ax.hist(r["diffs"], bins=48, range=(-np.pi, np.pi), color="tab:blue")
        ax.set_title(f"{r['phase_map']} {r['pair']}\nR̄={r['mean_resultant_length']:.3f} "
                     f"perm p={r['permutation_p']:.2g}", fontsize=8)
        ax.set_xlabel("phase difference (rad)", fontsize=7)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_gain_by_entropy(path: str, forking: dict, unit: str = "position") -> str:
    """Gain over the best single member by entropy decile: the best BRF setting and the
    best baseline of each variant, with 95% CIs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(forking), figsize=(5.2 * len(forking), 3.6),
                             squeeze=False, sharey=True)
    for ax, (v, f) in zip(axes[0], forking.items()):
        x = np.arange(1, 11)
        for kind, g in f.get("gated", {}).items():
            r = f["by_method"][g["method"]]
            m = np.asarray(r["mean_gain"])
            ci = np.asarray(r["ci"])
            ax.errorbar(x + (0.1 if kind == "brf" else -0.1), m,
                        yerr=[m - ci[:, 0], ci[:, 1] - m], fmt="o-", capsize=2,
                        label=f"{g['method']} (top {100 * f['top_fraction']:.0f}%: "
                              f"{100 * r['top_share']:.0f}% of gain)")
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_title(f"{v}: gain over {f['reference']}", fontsize=9)
        ax.set_xlabel("decile of the members' mean entropy (1 = most certain)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"NLL gain (nats/{unit})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
