"""The offline harness tasks shipped in tasks/, made from the study's own corpora.

* ``brf_hamlet_next_line`` (multiple choice): four lines of Hamlet, then the true next
  verse line among four (three verse lines from at least 200 lines away).
* ``brf_python_next_line`` (generative, exact match): six lines of pyparsing's core.py,
  then the next line, generated up to its end.

``python -m brf.harness.tasks`` rewrites tasks/data/*.jsonl from the pinned corpora
(tests/test_harness.py checks the committed files equal a fresh build).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "tasks"
N_ITEMS = 200


def _lines(corpus: str) -> list[str]:
    from brf.eval.corpus import load_named
    return load_named(corpus, min_chars=0)[0].split("\n")


def hamlet_next_line(n: int = N_ITEMS, seed: int = 0) -> list[dict]:
    """Rows {context, choices, label}: the true next line is ``choices[label]``."""
    lines = [ln for ln in _lines("hamlet") if ln.strip()]
    verse = [i for i, ln in enumerate(lines) if len(ln) >= 25 and not ln.isupper()
             and not ln.startswith(("#", "Enter", "Exit", "Exeunt"))]
    rng = np.random.default_rng(seed)
    picks = sorted(rng.choice([i for i in verse if i >= 4], n, replace=False).tolist())
    rows = []
    for i in picks:
        far = [j for j in verse if abs(j - i) > 200 and lines[j] != lines[i]]
        choices = [lines[i]] + [lines[j] for j in rng.choice(far, 3, replace=False)]
        order = rng.permutation(4)
        rows.append(dict(context="\n".join(lines[i - 4:i]) + "\n",
                         choices=[choices[k] for k in order],
                         label=int(np.argmin(order))))
    return rows


def python_next_line(n: int = N_ITEMS, seed: int = 0) -> list[dict]:
    """Rows {context, target}: six lines of code, then the next (non-blank) line."""
    lines = _lines("pyparsing")
    ok = [i for i in range(6, len(lines)) if len(lines[i].strip()) >= 20]
    rng = np.random.default_rng(seed)
    picks = sorted(rng.choice(ok, n, replace=False).tolist())
    return [dict(context="\n".join(lines[i - 6:i]) + "\n", target=lines[i]) for i in picks]


BUILDERS = {"hamlet_next_line": hamlet_next_line, "python_next_line": python_next_line}


def build(out_dir: pathlib.Path = TASKS_DIR / "data") -> list[pathlib.Path]:
    """Writes every shipped task's JSONL; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in BUILDERS.items():
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in make()),
                        encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in build():
        print(f"wrote {p}")
