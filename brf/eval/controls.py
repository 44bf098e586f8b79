"""Free-parameter counts of method specs, and the controls for a winning BRF spec.

Calibrated BRF with a per-token phase map beats the tuned pools; the controls
(:mod:`brf.fusion.controls`) ask whether the interference structure or the
extra freedom does it. This module gives each method spec
(:class:`brf.eval.fitting.MethodSpec` or its dict form) its count of free
parameters, and builds, from the winning BRF spec, the control specs with the
same freedom.

**Counting rule** (:func:`free_parameters`; nominal: fitted values, not
identifiable dimensions):

- a continuous parameter in ``fit`` counts its number of values (a scalar 1, a
  per-member list n);
- a phase map's ``offset`` is the exception: only phase *differences* enter
  ``|sum_i a_i|^2`` (a common phase added to every member changes nothing), so
  a per-member offset counts n - 1 and a shared (scalar) one 0;
- fitted member weights (on the simplex) count n - 1; ``fit_method`` fits them
  unless ``fit_weights=False``, ``fixed_weights`` or a ``weighting`` is given;
- ``weighting="perplexity"`` counts its temperature, 1;
- the calibrated variant counts its post-fusion temperature, 1, and, with more
  than one member, the per-member temperatures, n;
- a ``grid`` parameter with more than one value counts 1 (one discrete choice
  made on the calibration data); a one-value grid and ``fixed`` values count 0.

Not in a spec's count: choosing the best of several specs (e.g. BRF's best map
among eleven, the best baseline among two) is a selection across rows, to be
reported beside the counts. Nominal counts can exceed the identifiable
dimension where two parameters act the same way (the log-linear pool's own
temperature duplicates the calibrated variant's post-fusion temperature); the
controls built here avoid such duplicates.

**The controls of a BRF spec with a per-token map** (:func:`controls_for`):

- ``shuffled``: ``born_shuffled`` with the same map, initial values and fitted
  parameters: the same count as the BRF spec;
- ``reshape_linear`` / ``reshape_loglinear``: ``reshape`` with one strength per
  member and the curve's shape parameters fitted (tanh: ``rate``; sigmoid:
  ``rate`` and ``center``), pooled linearly / log-linearly. For the map's own
  curve this is the map's count (its scale and shape parameters plus n - 1
  offset differences = n strengths plus the shape parameters). A linear map's
  tilt would be a member temperature, which the calibrated variant already
  fits, so a linear map gets the tanh curve: one parameter more than BRF;
- ``capacity_pool``: ``power_members`` with one exponent per member (n) and,
  in the proposed variant, the outer order (1). In the calibrated variant the
  order would duplicate the post-fusion temperature and is held at 1. This
  matches a linear map's count (n) in the calibrated variant and a tanh map's
  (n + 1) in the proposed one; against a calibrated tanh map it has one
  parameter less (the reshaping controls match it there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import numpy as np

from brf.eval.fitting import MethodSpec
from brf.fusion import PHASE_MAPS


class ParamCount(NamedTuple):
    """A spec's free parameters.

    Attributes:
      total: the count (see the module docstring for the rule).
      parts: name -> count, every nonzero contribution (``weights``,
        ``calib.temperature``, ``calib.member_temperature``,
        ``weighting.temperature``, fitted parameter names, ``grid:<name>``).
    """
    total: int
    parts: dict


def free_parameters(spec: MethodSpec | Mapping[str, Any], n: int) -> ParamCount:
    """The number of free parameters of a method spec with n members.

    Args:
      spec: a :class:`brf.eval.fitting.MethodSpec` or its dict form.
      n: the number of members.

    Returns:
      A :class:`ParamCount`.
    """
    spec = MethodSpec.coerce(spec)
    parts: dict[str, int] = {}
    for key, value in spec.fit.items():
        size = int(np.size(value))
        if key == "phase.offset":
            size = size - 1 if size > 1 else 0
        parts[key] = size
    for key, values in spec.grid.items():
        if len(list(values)) > 1:
            parts[f"grid:{key}"] = 1
    if spec.weighting == "perplexity":
        parts.setdefault("weighting.temperature", 1)
    if spec.fit_weights and n > 1 and spec.weighting is None and spec.fixed_weights is None:
        parts["weights"] = n - 1
    if spec.variant == "calibrated":
        parts.setdefault("calib.temperature", 1)
        if n > 1:
            parts.setdefault("calib.member_temperature", n)
    parts = {k: v for k, v in parts.items() if v}
    return ParamCount(sum(parts.values()), parts)


def _base_label(spec: MethodSpec) -> str:
    suffix = f" [{spec.variant}]"
    if spec.variant != "proposed" and spec.label.endswith(suffix):
        return spec.label[:-len(suffix)]
    return spec.label


def _map_value(spec: MethodSpec, key: str, default: float) -> float:
    for where in (spec.fit, spec.fixed):
        v = where.get(f"phase.{key}")
        if v is not None:
            return float(np.asarray(v).reshape(-1)[0])
    return float(default)


def controls_for(brf_spec: MethodSpec | Mapping[str, Any], n: int, *, seed: int = 0,
                 reshape_curve: str | None = None) -> dict[str, MethodSpec]:
    """The control specs for a BRF spec with a per-token phase map.

    Args:
      brf_spec: a :class:`brf.eval.fitting.MethodSpec` (or its dict form) with
        ``method`` 'born' and ``phase`` a per-token map (``token_*``), in
        either variant.
      n: the number of members.
      seed: the phase shuffle's seed.
      reshape_curve: the reshaping controls' curve (default: the map's own
        curve, tanh for a linear map; see the module docstring).

    Returns:
      {role: MethodSpec} for ``shuffled``, ``reshape_linear``,
      ``reshape_loglinear`` and ``capacity_pool``, each with ``role='control'``,
      in the variant and with the weighting of ``brf_spec`` (labels as
      :meth:`MethodSpec.in_variant` writes them).

    Raises:
      ValueError: not a BRF spec with a per-token map, or an unknown curve.
    """
    brf = MethodSpec.coerce(brf_spec)
    if brf.method != "born" or not brf.phase:
        raise ValueError(f"controls_for takes a BRF spec (method 'born' with a phase map); "
                         f"got {brf}")
    name = brf.phase
    if PHASE_MAPS.get(name).kind != "token":
        raise ValueError(f"controls_for: phase map {name!r} gives one phase per position; "
                         f"the controls are defined for per-token maps (token_*)")
    curve = reshape_curve or (name[len("token_"):] if name != "token_linear" else "tanh")
    if curve == "constant" or curve not in PHASE_MAPS.names():
        raise ValueError(f"controls_for: unknown reshaping curve {curve!r}")
    proposed = dataclasses.replace(brf, label=_base_label(brf), variant="proposed",
                                   role="control")
    shuffled = dataclasses.replace(proposed, method="born_shuffled",
                                   label=f"{proposed.label}, phases shuffled",
                                   fixed={**brf.fixed, "seed": seed})
    shape = {k: _map_value(brf, k, v) for k, v in PHASE_MAPS.get(curve).defaults.items()
             if k != "scale"}
    out = {"shuffled": shuffled}
    for pool, what in (("linear", "linear"), ("loglinear", "log-linear")):
        out[f"reshape_{pool}"] = dataclasses.replace(
            proposed, label=f"reshape {curve} + {what} pool", method="reshape", phase=None,
            fit={"scale": [0.0] * n, **shape}, grid={}, fixed={"curve": curve, "pool": pool})
    if brf.variant == "calibrated":  # the order would duplicate the post-fusion temperature
        pm_fit, pm_fixed = {"alpha": [1.0] * n}, {"order": 1.0}
    else:
        pm_fit, pm_fixed = {"alpha": [0.5] * n, "order": 0.5}, {}
    out["capacity_pool"] = dataclasses.replace(
        proposed, label="power mean, per-member exponents", method="power_members",
        phase=None, fit=pm_fit, grid={}, fixed=pm_fixed)
    return {k: v.in_variant(brf.variant) for k, v in out.items()}
