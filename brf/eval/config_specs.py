"""The validation config's members, methods and phase maps, written as spec strings.

Flags can set all three (ml_collections cannot override a list of dicts)::

    --config.members='smollm2-135m-instruct, gemma3-270m'
    --config.methods='linear, loglinear(temperature=fit(1.0)), loglinear(temperature=1.0)'
    --config.phase_maps='constant(label="hellinger", fixed=True), tanh(scale=1.5, rate=0.5)'

**Method specs.** ``name(key=value, ...)`` with the method's own parameters and
these validation keys:

- a parameter given as a value is fixed; ``fit(init)`` fits it (L-BFGS) from
  ``init`` on the calibration split; ``grid(a, b, ...)`` picks the value with the
  lowest calibration NLL (combined with any fitted ones);
- ``label="..."`` names the row (default: the spec text);
- ``fit_weights=False`` keeps uniform member weights (default: fitted);
- ``weighting="perplexity"`` weighs members per position by their perplexity on
  the segment so far (PackLLM), with a fitted temperature;
- ``phase="tanh(rate=0.5)"`` (born) fixes a phase map.

**Phase-map specs** (one BRF row each): a phase map with its initial
parameters, fitted with the member weights and a per-member offset, plus
``label="..."`` (default: the map's name) and ``fixed=True`` (keep the map as
given, fit nothing: the reference points).

A list of dicts (the fields of :class:`~brf.eval.fitting.MethodSpec`) is read
too.
"""

from __future__ import annotations

from typing import Any, Mapping

from brf import specs as spec_lib
from brf.errors import UserError
from brf.eval.fitting import MethodSpec


class ConfigSpecError(UserError):
    """A member, method or phase-map spec in a config that cannot be used."""


_MARKERS = ("fit", "grid")


def _marker(value: Any, where: str) -> tuple[str, list] | None:
    """'fit(1.0)' -> ('fit', [1.0]); None for a plain value."""
    if not isinstance(value, str) or not value.strip().startswith(_MARKERS):
        return None
    name, args, kwargs = spec_lib.parse_call(value, where)
    if name not in _MARKERS or kwargs:
        raise ConfigSpecError(f"{where}: {value!r}; use fit(initial value) or "
                              f"grid(value, value, ...)")
    if name == "fit" and len(args) != 1:
        raise ConfigSpecError(f"{where}: fit(...) takes one initial value; got {value!r}")
    if name == "grid" and not args:
        raise ConfigSpecError(f"{where}: grid(...) needs at least one value")
    return name, args


def method_entry(text: str) -> MethodSpec:
    """One method spec string -> the :class:`~brf.eval.fitting.MethodSpec` it names."""
    name, params = spec_lib.parse_spec(text, "method")
    entry: dict[str, Any] = {"label": params.pop("label", text.strip()), "method": name}
    if "fit_weights" in params:
        fw = params.pop("fit_weights")
        if not isinstance(fw, bool):
            raise ConfigSpecError(f"method {text!r}: fit_weights must be True or False")
        entry["fit_weights"] = fw
    if "weighting" in params:
        w = params.pop("weighting")
        if w != "perplexity":
            raise ConfigSpecError(f"method {text!r}: weighting must be \"perplexity\" "
                                  f"(PackLLM); got {w!r}")
        entry["weighting"] = w
    if "phase" in params:
        from brf.fusion import phase_map
        pm = phase_map(params.pop("phase"))
        entry["phase"] = pm.name
        entry.setdefault("fixed", {}).update(
            {f"phase.{k}": _plain(v) for k, v in pm.params.items()})
    for key, value in params.items():
        where = f"method {text!r}, parameter {key}"
        mark = _marker(value, where)
        if mark is None:
            entry.setdefault("fixed", {})[key] = value
        elif mark[0] == "fit":
            entry.setdefault("fit", {})[key] = mark[1][0]
        else:
            entry.setdefault("grid", {})[key] = list(mark[1])
    return MethodSpec.coerce(entry)


def _plain(v):
    import numpy as np
    a = np.asarray(v)
    return a.item() if a.ndim == 0 else a.tolist()


def method_entries(methods: Any) -> list[MethodSpec]:
    """``config.methods`` (a spec string, or a list of specs / dicts) -> method specs."""
    if isinstance(methods, str):
        items = spec_lib.split_list(methods)
    else:
        items = list(methods)
    out = []
    for item in items:
        if isinstance(item, Mapping):
            item = dict(item)
            if "method" not in item:
                raise ConfigSpecError(f"config.methods: entry {item} has no 'method'")
            try:
                out.append(MethodSpec.coerce(item))
            except (TypeError, ValueError) as e:
                raise ConfigSpecError(f"config.methods: entry {item}: {e}") from None
        else:
            out.append(method_entry(str(item)))
    labels = [e.label for e in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ConfigSpecError(f"config.methods: duplicate labels {dup}; give each a label=")
    return out


def phase_map_entries(phase_maps: Any) -> dict[str, tuple[str, bool]]:
    """``config.phase_maps`` (a spec string or a list of specs, with ``label=`` and
    ``fixed=`` keys) -> {label: (phase spec text, fixed)}."""
    items = spec_lib.split_list(phase_maps) if isinstance(phase_maps, str) else list(phase_maps)
    out: dict[str, tuple[str, bool]] = {}
    for item in items:
        name, params = spec_lib.parse_spec(item, "phase map")
        label = params.pop("label", name)
        fixed = params.pop("fixed", False)
        if not isinstance(fixed, bool):
            raise ConfigSpecError(f"phase map {item!r}: fixed must be True or False")
        if label in out:
            raise ConfigSpecError(f"config.phase_maps: duplicate label {label!r}; give each "
                                  f"a label=")
        out[label] = (spec_lib.format_spec(name, params), fixed)
    return out


def member_entries(members: Any, supported: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """``config.members`` (a comma-separated spec string or a sequence) -> [(source, params)].

    Raises:
        ConfigSpecError: a parameter the experiment does not support (listed).
    """
    out = spec_lib.parse_list(members, "member")
    for name, params in out:
        unknown = sorted(set(params) - set(supported))
        if unknown:
            raise ConfigSpecError(
                f"member {name!r}: unknown parameter(s) {unknown}"
                + (f"; this experiment takes {list(supported)}" if supported
                   else "; this experiment takes none"))
    return out
