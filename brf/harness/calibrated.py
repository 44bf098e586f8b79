"""The study's calibrated rows as fusion methods: what ``study=<dir>:<corpus>`` runs.

The study (docs/study.md) fits each method in two variants; the *calibrated* one
tempers every member before fusion and the fused distribution after it
(``calib.member_temperature``, ``calib.temperature``, with the member weights and the
method's own parameters fitted on the calibration split). :func:`tempered` is that
wrapper as a registered fusion method (``brf.fusion.METHODS``, registered when this
module is imported): ``tempered(inner=born, inner_params={...}, member_temperature=[...],
temperature=...)`` is the study's ``fused_logq`` of the inner method with those
temperatures, so byte-level scoring and generation run it like any method.

:func:`study_row` reads a study report (README's main command writes one: results/study,
or a run's out_dir) and returns the calibrated variant's BRF row that the report's fair
summary chose at the byte level of one corpus, as a ``tempered`` method spec with its
fitted member weights.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

# The study's own tempering (what its calibrated rows were fitted with), not a copy.
from brf.eval.fitting import log_tempered
from brf.fusion import methods as M
from brf.harness.ensemble import HarnessInputError

NAME = "tempered"


def _all_positive(v) -> str | None:
    return None if bool(jnp.all(jnp.asarray(v) > 0)) else "must be > 0"


@M.register(
    NAME,
    member_temperature=M.Param(1.0, "floats", _all_positive,
                               doc="each member's temperature before fusion (one or one "
                                   "per member)"),
    temperature=M.Param(1.0, "float", M.positive, doc="the fused distribution's temperature"),
    inner=M.Param("linear", "method", doc="the fusion method between the two temperings"),
    inner_params=M.Param(None, "params", doc="parameters of the inner method"),
)
def tempered(logits, weights, *, member_temperature=1.0, temperature=1.0, inner="linear",
             inner_params=None):
    """A method between two temperings (the study's calibrated variant).

    ``log p_i <- log_softmax(log p_i / T_i)`` for each member, the inner method fuses
    them, then ``q <- q^(1/T) / Z``.

    Returns:
      (log q [..., V], the inner method's info).
    """
    n = logits.shape[-2]
    t = jnp.asarray(member_temperature, logits.dtype).reshape(-1)
    if t.shape[0] not in (1, n):
        raise M.FusionInputError(f"{NAME}: member_temperature must be one number or one per "
                                 f"member ({n}); got {t.shape[0]}")
    logp = log_tempered(logits, jnp.broadcast_to(t, (n,))[:, None])
    fused, info = M.get_method(inner).fn(logp, weights, **(inner_params or {}))
    return log_tempered(fused, jnp.asarray(temperature, logits.dtype)), info


@dataclasses.dataclass(frozen=True)
class StudyRow:
    """A fitted row of a study report, as a fusion method.

    Attributes:
        label: the row's label in the report.
        corpus: the corpus it was fitted on.
        members: the study's member names, in order.
        method, params: the ``tempered`` method spec (its inner method and parameters).
        weights: the fitted member weights.
        report: the report file it was read from.
    """
    label: str
    corpus: str
    members: tuple[str, ...]
    method: str
    params: dict
    weights: tuple[float, ...]
    report: str


def parse_study(spec: str) -> tuple[str, str]:
    """``'<dir>:<corpus>'`` -> (dir, corpus); refused unless both are given."""
    where, sep, corpus = str(spec).rpartition(":")
    if not sep or not where or not corpus:
        raise HarnessInputError(f"study={spec!r}; give <study dir>:<corpus>, e.g. "
                                "results/study:hamlet")
    return where, corpus


def study_row(spec: str) -> StudyRow:
    """The calibrated BRF row that the byte-level analysis of one corpus of a study
    chose (its fair summary's BRF row), read from ``<dir>/<corpus>/bytes/``.

    Raises:
        HarnessInputError: no such directory, corpus or report; a row brf cannot run
            per byte (per-position weights).
    """
    where, corpus = parse_study(spec)
    if not os.path.isdir(where):
        raise HarnessInputError(f"study={spec!r}: {where!r} is not a directory (README's "
                                "main command writes a study: results/study)")
    found = sorted(glob.glob(os.path.join(glob.escape(where), glob.escape(corpus), "bytes",
                                          "report-*__bytes-*.json")))
    if len(found) != 1:
        known = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(
            os.path.join(glob.escape(where), "*", "bytes")))
        raise HarnessInputError(
            f"study={spec!r}: " + ("no byte-level report of corpus " f"{corpus!r}; "
                                   f"the study has {known or 'none'}" if not found else
                                   f"{len(found)} byte-level reports of {corpus!r}"))
    try:
        with open(found[0], encoding="utf-8") as f:
            data = json.load(f)
        label = data["fair_summary"]["calibrated"]["brf"]["label"]
        row = next(m for m in data["methods"] if m["label"] == label)
        members = tuple(m["name"] if isinstance(m, dict) else m for m in data["members"])
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise HarnessInputError(f"study={spec!r}: {found[0]} is not a study report with a "
                                f"calibrated fair summary ({type(e).__name__}: {e})") from None
    params = dict(row["params"])
    if any(k.startswith("weighting.") for k in params):
        raise HarnessInputError(f"study={spec!r}: row {label!r} weighs members per position "
                                "(PackLLM), which the harness does not run")
    inner = {k: v for k, v in params.items()
             if not k.startswith(("calib.", "phase"))}
    if "phase" in params:
        phase = {k[len("phase."):]: v for k, v in params.items() if k.startswith("phase.")}
        inner["phase"] = dict(phase, name=params["phase"])
    spec_params: dict[str, Any] = dict(inner=row["method"], inner_params=inner)
    if "calib.member_temperature" in params:
        spec_params["member_temperature"] = [float(t) for t in
                                             np.ravel(params["calib.member_temperature"])]
    if "calib.temperature" in params:
        spec_params["temperature"] = float(params["calib.temperature"])
    return StudyRow(label=label, corpus=corpus, members=members, method=NAME,
                    params=spec_params, weights=tuple(float(w) for w in row["weights"]),
                    report=found[0])


__all__ = ["NAME", "StudyRow", "parse_study", "study_row", "tempered"]
