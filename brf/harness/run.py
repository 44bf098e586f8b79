"""What experiments/harness.py runs: one brf ensemble, several variants (each member
alone, pools, BRF), each through ``lm_eval.simple_evaluate`` on the same tasks; the
harness's own results JSON per variant and a short table of them all.

Imports lm_eval (the ``harness`` extra) when :func:`run` is called, not before.
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

from brf.harness.ensemble import HarnessInputError

MEMBERS = "members"  # the variant 'every member alone'


def variants(spec: str, n_members: int) -> list[tuple[str, list[int], str]]:
    """(label, member indices, method spec) of each variant in ``config.variants``: a
    comma-separated list of method specs (brf.specs), ``members`` for each member alone."""
    from brf.specs import format_spec, parse_list
    out = []
    for name, params in parse_list(spec, "variant"):
        if name == MEMBERS:
            if params:
                raise HarnessInputError("variant 'members' takes no parameters")
            out += [(f"member {j}", [j], "linear") for j in range(n_members)]
        else:
            method = format_spec(name, params)
            out.append((method, list(range(n_members)), method))
    if not out:
        raise HarnessInputError("config.variants names no variant")
    return out


def _metrics(task_result: dict) -> list[tuple[str, float, float | None]]:
    """(metric, value, standard error) of one task's results, as the harness keys them."""
    out = []
    for key, value in task_result.items():
        if "_stderr" in key or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        metric, _, filt = key.partition(",")
        err = task_result.get(f"{metric}_stderr,{filt}")
        out.append((key if filt not in ("none", "") else metric, float(value),
                    float(err) if isinstance(err, (int, float)) else None))
    return out


def table(rows: Sequence[dict]) -> str:
    """A Markdown table: one line per variant and task metric, value ± standard error."""
    lines = ["| variant | task | metric | value | stderr |", "|---|---|---|---|---|"]
    for r in rows:
        for task, metrics in r["tasks"].items():
            for metric, value, err in metrics:
                shown = "-" if err is None or math.isnan(err) else f"{err:.4f}"
                lines.append(f"| {r['variant']} | {task} | {metric} | {value:.4f} | {shown} |")
    lost = [r for r in rows if r.get("bytes")]
    if lost:
        lines += ["", "Byte level: the pruned log-mass per member (nats; a log-likelihood lies "
                      "at most this far below the exact one):", ""]
        for r in lost:
            b = r["bytes"]
            lines.append(f"- {r['variant']}: {b['requests']} requests, largest "
                         + ", ".join(f"{x:.3g}" for x in b["lost_max"]) + "; mean "
                         + ", ".join(f"{x:.3g}" for x in b["lost_mean"]))
    return "\n".join(lines) + "\n"


def check_tasks(tasks: Sequence[str], include_path: str):
    """The task manager, with every task known and loadable (offline too).

    Raises:
        HarnessInputError: an unknown task, or one whose data cannot be loaded.
    """
    from lm_eval.tasks import TaskManager, get_task_dict
    if include_path and not os.path.isdir(include_path):
        raise HarnessInputError(f"config.include_path {include_path!r} is not a directory")
    tm = TaskManager(include_path=include_path or None)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise HarnessInputError(f"unknown task(s) {unknown}; see `lm-eval ls tasks` (shipped "
                                "offline: brf_hamlet_next_line, brf_python_next_line with "
                                "include_path=tasks)")
    try:
        get_task_dict(list(tasks), tm)
    except Exception as e:  # noqa: BLE001 -- datasets raises many kinds; all mean the same
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise HarnessInputError(f"task(s) {list(tasks)} cannot be loaded (offline, the "
                                f"dataset must be on this machine): {type(e).__name__}: "
                                f"{first}") from None
    return tm


def run(c) -> list[dict]:
    """Runs every variant of config ``c`` (configs/harness.py) on its tasks; writes
    ``<output>/<variant>.json`` (the harness's results) and ``<output>/table.md``.

    Returns:
        Per variant: {'variant', 'tasks': {task: [(metric, value, stderr)]}, 'bytes'}.
    """
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    from brf.ensemble.run import load_members
    from brf.harness.lm import BRFLM, ModelArgs, byte_summary
    tasks = [t for t in c.tasks]
    base = dict(level=c.level, precision=c.precision, batch_size=c.batch_size,
                max_gen_toks=c.max_gen_toks, seed=c.seed, dtype=c.dtype,
                speculative=c.get("speculative", ""))
    if c.max_length:
        base["max_length"] = c.max_length
    ModelArgs.parse(dict(base, members=c.members, phase=c.phase))  # before any model loads
    from brf.specs import parse_list
    plan = variants(c.variants, len(parse_list(c.members, "member")))
    for _, _, method in plan:
        ModelArgs.parse(dict(base, members=c.members, method=method, phase=c.phase))
    tm = check_tasks(tasks, c.include_path)
    os.makedirs(c.output, exist_ok=True)
    members = load_members(c.members)
    rows = []
    for label, idx, method in plan:
        chosen = [members[j] for j in idx]
        if len(chosen) == 1:  # a member alone: weight 1
            import dataclasses
            chosen = [dataclasses.replace(chosen[0], weight=None)]
        phase = c.phase if len(chosen) > 1 else ""
        lm = BRFLM(members=chosen, method=method, phase=phase, **base)
        print(f"{label}: {', '.join(m.name for m in chosen)} ({lm.level} level)")
        res = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=c.num_fewshot if c.num_fewshot >= 0 else None,
            limit=c.limit or None, task_manager=tm, log_samples=c.log_samples,
            random_seed=c.seed, numpy_random_seed=c.seed, torch_random_seed=c.seed,
            fewshot_random_seed=c.seed)
        name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
        with open(os.path.join(c.output, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
        rows.append(dict(variant=label, members=[m.name for m in chosen],
                         tasks={t: _metrics(r) for t, r in res["results"].items()},
                         bytes=byte_summary(lm.byte_reports)))
    text = table(rows)
    with open(os.path.join(c.output, "table.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return rows


__all__ = ["check_tasks", "run", "table", "variants"]
