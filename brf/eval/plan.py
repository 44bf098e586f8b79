"""The study's plan: the config read and checked once, as frozen records.

``experiments/validate.py`` turns its ``ml_collections`` config into a
:class:`Plan` with :func:`from_config`; nothing below the main reads the config.
Every mistake a user can make in it (an unknown member parameter, method, phase
map, corpus or variant; a bad split; a corpus too short to split) is found here,
before any model is loaded, and raised as :class:`ValidationError` (one line,
exit status 2 in a main).

A plan names *what* to run: the members, the corpora, the method specs in each
variant, and for each corpus the analyses (:class:`Analysis`: which members, on
which event space, in which variants) at each level: ``'tokens'`` (co-aligned
positions, :mod:`brf.eval.events`) and, when ``plan.bytes.enabled``, ``'bytes'``
(every byte, :mod:`brf.eval.byte_scorer`). ``brf.eval.study`` runs it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from brf import schema as S
from brf.bytes import (CHECK_BYTES, DEFAULT_BEAM, DEFAULT_MAX_LAG, DEFAULT_THRESHOLD, REFERENCE,
                       Settings)
from brf.errors import UserError
from brf.eval import config_specs
from brf.eval import corpus as corpus_lib
from brf.eval.fitting import VARIANTS, FitSettings, MethodSpec, perturbations
from brf.specs import format_spec, parse_list, split_list

MIN_SPLIT_POSITIONS = 50   # per split: below this no test or fit means much
# The stability check's reach (brf.eval.stability), in nats of calibration NLL: it
# refits the rows within this of the best row of some set a verdict chooses from (and
# every control); a row further up could enter a choice only by moving further than
# that. Twice the largest move a refit made on the study's real tables (9.9e-3, the
# swarm's; BENCHMARKS.md, "The stability check on the real tables"), and a check that
# sees a row move by more than half its reach widens it to twice that move and refits
# the rows it brings in, so the rule rests on what the check itself measured.
STABILITY_REACH = 0.02
# The levels an analysis runs at: co-aligned token positions, or every byte.
LEVELS = ("tokens", "bytes")


class ValidationError(UserError):
    """A bad validation config or corpus, reported before any model runs."""


@dataclasses.dataclass(frozen=True)
class Member:
    """A member of an analysis: a model (registry name, GGUF file or HF directory)
    and an optional prefix it reads before every segment."""
    name: str
    prefix: str = ""

    @property
    def label(self) -> str:
        """The member's name in reports (its spec text)."""
        return format_spec(self.name, {"prefix": self.prefix} if self.prefix else {})

    def with_prefix(self, prefix: str) -> "Member":
        return dataclasses.replace(self, prefix=prefix)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One corpus of the study (``brf.eval.corpus.CORPORA`` name or a UTF-8 file)."""
    name: str
    label: str
    max_chars: int = 0
    skip_chars: int = 0
    prefix: str = ""   # the prompt study's steadying prefix ("" = none)


@dataclasses.dataclass(frozen=True)
class PhaseMapEntry:
    """One BRF row per phase map: its spec text; ``fixed`` keeps it as given."""
    label: str
    spec: str
    fixed: bool = False


@dataclasses.dataclass(frozen=True)
class SweepCurve:
    """Test NLL of BRF (uniform weights) along one parameter of one phase map."""
    label: str
    phase_map: str
    param: str
    values: tuple[float, ...]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ScoringSettings:
    segment_chars: int = 3000
    top_k: int = 64
    chunk: int = 256
    min_chars: int = 2000
    calibration_fraction: float = 0.5


@dataclasses.dataclass(frozen=True)
class StatsSettings:
    n_boot: int = 2000
    n_perm: int = 2000
    seed: int = 0
    forking_top_fraction: float = 0.2


@dataclasses.dataclass(frozen=True)
class PromptSettings:
    enabled: bool = True
    second_prefix: str = ""
    swarm: bool = True
    variants: tuple[str, ...] = ("calibrated",)


@dataclasses.dataclass(frozen=True)
class BottleneckSettings:
    positions: int = 0
    top_k: int = 256


@dataclasses.dataclass(frozen=True)
class ByteSettings:
    """The study on every byte: on or off, and each member's pruning
    (`brf.bytes.lm.score_text`: at most ``beam`` hypotheses per byte, those below
    ``threshold`` of the prefix mass dropped, hypotheses that fall more than
    ``max_lag`` canonical tokens behind merged into the canonical one). The
    defaults are brf.bytes' (``DEFAULT_BEAM``, ``DEFAULT_THRESHOLD``,
    ``DEFAULT_MAX_LAG``), here, in a config without those keys and in
    configs/validate.py alike.

    ``check_bytes``: the precision check's slice (:mod:`brf.eval.byte_precision`: that
    many bytes of each corpus's first test segment rescored by each member of the
    default pair with the ``reference`` settings; 0: no check).

    ``max_chars``: the byte level reads each corpus's first segments up to this many
    characters (whole segments, at least two, so that it has a calibration and a test
    split; :meth:`brf.eval.levels.LoadedCorpus.head`); 0: every segment. ``prompts``:
    the prompt study (prefix pair, same-model pair, swarm) at the byte level too."""
    enabled: bool
    beam: int = DEFAULT_BEAM
    threshold: float = DEFAULT_THRESHOLD
    max_lag: int = DEFAULT_MAX_LAG
    swarm: bool = True  # the prompt study's swarm on every byte too (its fits are the longest)
    check_bytes: int = CHECK_BYTES
    reference: Settings = REFERENCE
    max_chars: int = 0
    prompts: bool = True

    @property
    def settings(self) -> Settings:
        """The members' byte-level settings in the study."""
        return Settings(self.beam, self.threshold, self.max_lag)


BYTES_OFF = ByteSettings(enabled=False)  # a config without c.bytes


@dataclasses.dataclass(frozen=True)
class Analysis:
    """One event table to analyse: which members, at which level, how many top
    strings per member, in which variants.

    Attributes:
      kind: 'corpus' (the default pair), 'topk' (the event-space check), 'prefix'
        (each member with the corpus's prefix), 'same_model' (member 0 under two
        prefixes) or 'swarm' (each member with and without the prefix).
      label: the analysis's name in reports.
      members: who is scored and fused.
      top_k: top strings per member in the event space (0 at the byte level, whose
        event space is always the 257 byte events).
      store_k: top strings kept in the score stores (>= top_k; the first corpus
        stores the sensitivity check's larger k so that both analyses share it;
        0 at the byte level).
      variants: method variants fitted.
      sweep: draw the sweep curves and per-analysis plots.
      level: 'tokens' (co-aligned positions, an event space of top strings) or
        'bytes' (every byte, the 257 byte events; no event-space check there).
    """
    kind: str
    label: str
    members: tuple[Member, ...]
    top_k: int
    store_k: int
    variants: tuple[str, ...]
    sweep: bool = False
    level: str = "tokens"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything one run of the study does, checked."""
    members: tuple[Member, ...]
    corpora: tuple[Corpus, ...]
    methods: tuple[MethodSpec, ...]          # the configured methods, as proposed
    phase_maps: tuple[PhaseMapEntry, ...]
    variants: tuple[str, ...]
    nll_baselines: tuple[str, ...]
    sweep: tuple[SweepCurve, ...]
    scoring: ScoringSettings
    fit: FitSettings
    stats: StatsSettings
    prompts: PromptSettings
    bottleneck: BottleneckSettings
    topk_sensitivity: int
    out_dir: str
    bytes: ByteSettings = BYTES_OFF
    controls: bool = True
    stability: str = ""                      # the stability check's perturbation ('': off)
    stability_reach: float = STABILITY_REACH  # rows this far up are not refitted (inf: all)
    mesh: Mapping[str, Any] | None = None
    distributed: Mapping[str, Any] | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def phase_maps_for(self, n: int) -> tuple[PhaseMapEntry, ...]:
        """The maps usable with n members. A map given one offset per member for a
        different number of members is left out (e.g. the linear-pool reference
        ``offset=[0, pi/2]`` has no n = 4 counterpart: four phases cannot all differ
        pairwise by pi/2)."""
        from brf.fusion import phase_map
        keep = []
        for e in self.phase_maps:
            offset = np.asarray(phase_map(e.spec).params["offset"])
            if offset.ndim == 0 or offset.shape[0] == n:
                keep.append(e)
        return tuple(keep)

    def method_specs(self, n: int, variants: Sequence[str] | None = None) -> list[MethodSpec]:
        """The configured methods, each member alone and one BRF row per phase map,
        in every variant (as proposed first)."""
        from brf.fusion import phase_map
        base = list(self.methods)
        for i in range(n):
            base.append(MethodSpec(f"member {i} alone", "linear", fit_weights=False,
                                   fixed_weights=tuple(float(j == i) for j in range(n)),
                                   role="member"))
        for e in self.phase_maps_for(n):
            pm = phase_map(e.spec)
            if e.fixed:  # reference points: keep the map as given
                fit = {}
                fixed = {f"phase.{k}": np.asarray(v).tolist() for k, v in pm.params.items()}
            else:
                fit = {f"phase.{k}": float(np.asarray(v).reshape(-1)[0])
                       for k, v in pm.params.items() if k != "offset"}
                fit["phase.offset"] = [0.0] + [0.5] * (n - 1)
                fixed = {}
            base.append(MethodSpec(f"born {e.label}", "born", fit=fit, fixed=fixed,
                                   phase=pm.name, role="brf"))
        return [s.in_variant(v) for v in (variants or self.variants) for s in base]

    def analyses(self, index: int, level: str = "tokens") -> list[Analysis]:
        """The analyses of corpus ``index`` at ``level``: the default pair (with the
        sweep), the event-space check (first corpus, tokens only), and the prompt
        study where the corpus has a prefix. At the byte level the same kinds but
        the event-space check (and the prompt study when ``bytes.prompts`` is off, the
        swarm when ``bytes.swarm`` is), none when ``bytes.enabled`` is off."""
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; use one of {LEVELS}")
        if level == "bytes" and not self.bytes.enabled:
            return []
        c = self.corpora[index]
        tokens = level == "tokens"
        k = self.scoring.top_k if tokens else 0
        k2 = self.topk_sensitivity if index == 0 and tokens else 0
        store_k = k2 or k
        tag = "" if tokens else " (bytes)"
        out = [Analysis("corpus", c.label + tag, self.members, k, store_k, self.variants,
                        sweep=True, level=level)]
        if k2:
            out.append(Analysis("topk", f"{c.label} (top-{k2})", self.members, k2, k2,
                                self.variants))
        if c.prefix and self.prompts.enabled and (tokens or self.bytes.prompts):
            aux = self.prompts.variants
            out.append(Analysis("prefix", f"{c.label} + prefix{tag}",
                                tuple(m.with_prefix(c.prefix) for m in self.members),
                                k, store_k, aux, level=level))
            if self.prompts.second_prefix:
                m0 = self.members[0]
                out.append(Analysis("same_model", f"{c.label} same model{tag}",
                                    (m0.with_prefix(c.prefix),
                                     m0.with_prefix(self.prompts.second_prefix)),
                                    k, store_k, aux, level=level))
            if self.prompts.swarm and (tokens or self.bytes.swarm):
                swarm = tuple(x for m in self.members for x in (m, m.with_prefix(c.prefix)))
                out.append(Analysis("swarm", f"{c.label} swarm{tag}", swarm, k, store_k, aux,
                                    level=level))
        return out


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


def load_segments(plan: Plan, corpus: Corpus) -> tuple[list[str], str, str]:
    """(segments, source, licence) of one corpus of the plan."""
    text, source, licence = corpus_lib.load_named(
        corpus.name, max_chars=corpus.max_chars, skip_chars=corpus.skip_chars,
        min_chars=plan.scoring.min_chars)
    return split_segments(text, plan.scoring.segment_chars), source, licence


# ----------------------------------------------------------------- from a config

MEMBER_KEYS = ("prefix",)
CORPUS_KEYS = ("max_chars", "skip_chars", "prefix", "label")
# Top strings per member: the event table holds positions x members x (1 + members
# x top_k) floats, 2.6 GB at 10,000 positions, two members and 4096.
TOP_K_MAX = 4096
# Tokens per forward pass: a pass's logits are chunk x vocabulary floats (4 GB at
# 4096 x Gemma's 262,144).
CHUNK_MAX = 4096


def _spec_list(what: str, registry: str, *, key: str = "name", empty: bool = True):
    """A check that a spec list (a comma-separated string, or a list of specs or
    dicts) parses and that each spec names an entry of the registry
    (``'methods'`` or ``'phase maps'``); the values are checked by from_config,
    which may touch JAX."""
    def check(value):
        if not isinstance(value, (str, list, tuple)):
            raise ValidationError(f"must be a comma-separated string of {what} specs; got "
                                  f"{value!r}")
        if isinstance(value, str) and registry == "phase maps":
            specs = [parse_list(spec, what)[0] for spec, _ in
                     config_specs.phase_map_entries(value).values()]
        else:
            specs = parse_list(value, what, key=key)
        if not specs and not empty:
            raise ValidationError(f"names no {what}")
        from brf.fusion import METHODS
        from brf.fusion.phase import PHASE_MAPS
        for name, _ in specs:
            (METHODS if registry == "methods" else PHASE_MAPS).get(name)
    return check


def _members_check(value):
    members = _members(value)
    seen = set()
    for m in members:
        if m in seen:
            raise ValidationError(
                f"config.members lists {m.label!r} twice: two identical members fuse to "
                f"themselves, so the study would compare a model with itself; give one of "
                f"them another prefix= (a prompt ensemble) or name another model")
        seen.add(m)


def _sweep_check(value):
    from brf.fusion.phase import PHASE_MAPS
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValidationError(f"config.sweep must be a list of curves (dicts); got {value!r}")
    for i, entry in enumerate(value, 1):
        if not hasattr(entry, "items"):
            raise ValidationError(f"config.sweep[{i}] must be a dict; got {entry!r}")
        e = dict(entry)
        missing = [k for k in ("label", "phase_map", "param", "values") if k not in e]
        unknown = sorted(set(e) - {"label", "phase_map", "param", "values", "fixed"})
        if missing or unknown:
            raise ValidationError(f"config.sweep[{i}]: " + (
                f"missing {missing}" if missing else f"unknown keys {unknown}")
                + "; a curve has label, phase_map, param, values and optionally fixed")
        for key in ("label", "phase_map", "param"):
            if not isinstance(e[key], str) or not e[key]:
                raise ValidationError(f"config.sweep[{i}].{key} must be a non-empty string; "
                                      f"got {e[key]!r}")
        d = PHASE_MAPS.get(parse_list(e["phase_map"], "phase map")[0][0])
        allowed = sorted(set(d.defaults) | {"offset", "offset_difference"})
        if e["param"] not in allowed:
            raise ValidationError(f"config.sweep[{i}].param={e['param']!r}: the phase map "
                                  f"{e['phase_map']!r} has no such parameter; use one of "
                                  f"{allowed}")
        values = e["values"]
        S.numbers().validate(list(values) if isinstance(values, (list, tuple)) else values,
                             f"config.sweep[{i}].values")
        if not hasattr(e.get("fixed", {}), "items"):
            raise ValidationError(f"config.sweep[{i}].fixed must be a dict of the map's "
                                  f"parameters; got {e['fixed']!r}")


def _variants_check(where: str, allow_empty: bool = False):
    def check(value):
        if allow_empty and not _names(value):
            return
        _variants(value, where)
    return check


def _perturbation_check(value):
    try:
        perturbations(value)
    except ValueError as e:
        raise ValidationError(str(e)) from None


def _corpora_check(value):
    for c in _corpora(value):
        if c.name not in corpus_lib.CORPORA and not os.path.isfile(c.name):
            raise corpus_lib.CorpusError(
                f"unknown corpus {c.name!r}: neither a registered corpus "
                f"({', '.join(corpus_lib.CORPORA.names())}) nor an existing file")


def _mesh_axis():
    return S.integer(1, S.DEVICES_MAX, special=(-1,),
                     note="-1: every device the other axis leaves")


SCHEMA = {
    "members": S.text(empty=False, check=_members_check),
    "corpora": S.text(empty=False, check=_corpora_check),
    "out_dir": S.text(empty=False),
    "variants": S.text(check=_variants_check("config.variants")),
    "methods": S.custom(_spec_list("method", "methods", key="method")),
    "nll_baselines": S.custom(_spec_list("method", "methods", empty=False)),
    "controls": S.flag(),
    "phase_maps": S.custom(_spec_list("phase map", "phase maps", empty=False)),
    "sweep": S.custom(_sweep_check),
    "scoring.segment_chars": S.integer(16, 10**6),
    "scoring.top_k": S.integer(2, TOP_K_MAX),
    "scoring.chunk": S.integer(1, CHUNK_MAX),
    "scoring.min_chars": S.integer(0, S.COUNT_MAX),
    "scoring.calibration_fraction": S.number(0, 1, low_open=True, high_open=True,
                                             note="so that both splits have positions"),
    "fit.max_iter": S.integer(1, 10**6),
    "fit.ftol": S.number(0, 1, low_open=True, high_open=True),
    "fit.gtol": S.number(0, 1, low_open=True, high_open=True),
    "fit.calib_range": S.number(1, None, low_open=True, special=(0, 0.0),
                                note="0: unbounded"),
    "fit.param_range": S.number(1, None, low_open=True, special=(0, 0.0),
                                note="0: unbounded"),
    "fit.starts": S.integer(0, 1000),
    "fit.perturb": S.text(check=_perturbation_check),
    "stability": S.text(check=_perturbation_check, note="'': off"),
    "stability_reach": S.number(0, None, low_open=True, special=(0, 0.0),
                                note="nats; 0: every calibrated row"),
    "stats.n_boot": S.integer(10, S.RESAMPLES_MAX),
    "stats.n_perm": S.integer(10, S.RESAMPLES_MAX),
    "stats.seed": S.seed(),
    "stats.forking_top_fraction": S.number(0, 1, low_open=True, high_open=True),
    "prompts.enabled": S.flag(),
    "prompts.second_prefix": S.text(),
    "prompts.swarm": S.flag(),
    "prompts.variants": S.text(check=_variants_check("config.prompts.variants", True)),
    "bottleneck.positions": S.integer(0, 100_000, note="0: off"),
    "bottleneck.top_k": S.integer(0, 2**18, note="0: the whole vocabulary"),
    "topk_sensitivity": S.integer(0, TOP_K_MAX, note="0: off"),
    "bytes.enabled": S.flag(),
    "bytes.beam": S.integer(1, 2**16),
    "bytes.threshold": S.number(0, 1, high_open=True),
    "bytes.max_lag": S.integer(0, 10**6),
    "bytes.swarm": S.flag(),
    "bytes.check_bytes": S.integer(0, 10**6, note="0: no precision check"),
    "bytes.reference_beam": S.integer(1, 2**16),
    "bytes.reference_threshold": S.number(0, 1, high_open=True),
    "bytes.max_chars": S.integer(0, S.COUNT_MAX, note="0: every segment"),
    "bytes.prompts": S.flag(),
    "compilation_cache": S.flag(),
    "compilation_cache_dir": S.text(),
    "mesh.data": _mesh_axis(),
    "mesh.model": _mesh_axis(),
    "mesh.placement": S.text(choices=("shared", "apart")),
    "distributed.enabled": S.flag(),
    "distributed.coordinator_address": S.text(),
    "distributed.num_processes": S.integer(0, S.DEVICES_MAX, note="0: detect"),
    "distributed.process_id": S.integer(0, S.DEVICES_MAX - 1, special=(-1,),
                                        note="-1: detect"),
}


def check_config(cfg) -> None:
    """Every key of a validation config against :data:`SCHEMA`: types, ranges and
    names, without JAX (the main checks before ``jax.distributed.initialize``).

    Raises:
        ConfigError (a UserError): the first key that is wrong, named.
    """
    S.check(cfg, SCHEMA, error=ValidationError)


def from_config(cfg) -> Plan:
    """The plan of a validation config (configs/validate.py), checked.

    Raises:
        ValidationError (and the other UserErrors of config_specs and corpus): a
        mistake in the config, named.
    """
    check_config(cfg)
    members = tuple(_members(cfg.members))
    if len(members) < 2:
        raise ValidationError(f"config.members={cfg.members!r} names {len(members)}: "
                              f"the study needs at least two members")
    baselines = tuple(_names(cfg.nll_baselines))
    methods = tuple(_methods(cfg.methods, baselines))
    if not any(m.role == "baseline" for m in methods):
        raise ValidationError(
            f"config.methods={cfg.methods!r} holds none of config.nll_baselines "
            f"({', '.join(baselines)}): the study's NLL verdict compares BRF with them; "
            f"add one (e.g. --config.methods=linear) or name a configured method in "
            f"config.nll_baselines")
    phase_maps = tuple(_phase_maps(cfg.phase_maps))
    variants = _variants(cfg.variants, "config.variants")
    sc = cfg.scoring
    scoring = ScoringSettings(int(sc.segment_chars), int(sc.top_k), int(sc.chunk),
                              int(sc.min_chars), float(sc.calibration_fraction))
    k2 = int(cfg.topk_sensitivity)
    if k2 and k2 <= scoring.top_k:
        raise ValidationError(f"topk_sensitivity ({k2}) must exceed scoring.top_k "
                              f"({scoring.top_k}), or be 0 (off)")
    fit = FitSettings(max_iter=int(cfg.fit.max_iter), ftol=float(cfg.fit.ftol),
                      gtol=float(cfg.fit.gtol), calib_range=float(cfg.fit.calib_range),
                      param_range=float(cfg.fit.get("param_range", 1000.0)),
                      starts=int(cfg.fit.get("starts", FitSettings.starts)),
                      perturb=str(cfg.fit.get("perturb", "") or ""))
    st = cfg.stats
    stats = StatsSettings(int(st.n_boot), int(st.n_perm), int(st.seed),
                          float(st.forking_top_fraction))
    pr = cfg.prompts
    prompts = PromptSettings(bool(pr.enabled), str(pr.second_prefix), bool(pr.swarm),
                             _variants(pr.variants or cfg.variants, "config.prompts.variants"))
    bottleneck = BottleneckSettings(int(cfg.bottleneck.positions), int(cfg.bottleneck.top_k))
    byte_settings = _byte_settings(cfg.get("bytes"))
    stability = str(cfg.get("stability", "") or "")
    reach = float(cfg.get("stability_reach", STABILITY_REACH))
    plan = Plan(members=members, corpora=tuple(_corpora(cfg.corpora)), methods=methods,
                phase_maps=phase_maps, variants=variants, nll_baselines=baselines,
                sweep=tuple(_sweep(cfg.sweep)), scoring=scoring, fit=fit, stats=stats,
                prompts=prompts, bottleneck=bottleneck, topk_sensitivity=k2,
                out_dir=str(cfg.out_dir), bytes=byte_settings, controls=bool(cfg.controls),
                stability=stability, stability_reach=reach if reach > 0 else math.inf,
                mesh=_plain(cfg.get("mesh")),
                distributed=_plain(cfg.get("distributed")), config=cfg.to_dict())
    for c in plan.corpora:  # a corpus too short for the split fails here, not after scoring
        segments, _, _ = load_segments(plan, c)
        if len(segments) < 2:
            raise ValidationError(
                f"corpus {c.label!r}: {sum(map(len, segments))} characters make "
                f"{len(segments)} segment(s) of <= {scoring.segment_chars}; the "
                f"calibration/test split needs at least 2")
    return plan


def _byte_settings(section) -> ByteSettings:
    """config.bytes (checked by :data:`SCHEMA`: a beam or threshold the byte level
    refuses is named even when the byte level is off), its absent keys at brf.bytes'
    defaults; no section: off."""
    if section is None:
        return BYTES_OFF
    get = section.get
    reference = Settings(int(get("reference_beam", REFERENCE.beam)),
                         float(get("reference_threshold", REFERENCE.threshold)), 0)
    return ByteSettings(bool(section.enabled), int(get("beam", DEFAULT_BEAM)),
                        float(get("threshold", DEFAULT_THRESHOLD)),
                        int(get("max_lag", DEFAULT_MAX_LAG)), bool(get("swarm", True)),
                        int(get("check_bytes", ByteSettings.check_bytes)), reference,
                        int(get("max_chars", 0)), bool(get("prompts", True)))


def _plain(x):
    return None if x is None else (x.to_dict() if hasattr(x, "to_dict") else dict(x))


def _names(value) -> list[str]:
    return split_list(value) if isinstance(value, str) else [str(v) for v in value]


def _members(value) -> list[Member]:
    out = []
    for name, params in config_specs.member_entries(value, supported=MEMBER_KEYS):
        prefix = params.get("prefix", "")
        if not isinstance(prefix, str):
            raise ValidationError(f"member {name!r}: prefix must be a string; got {prefix!r}")
        out.append(Member(name, prefix))
    return out


def _methods(value, baselines: Sequence[str]) -> list[MethodSpec]:
    from brf.fusion import get_method
    from brf.fusion.methods import resolve_params
    out = []
    for spec in config_specs.method_entries(value):
        try:
            m = get_method(spec.method)
            given = {**spec.fixed, **spec.fit, **{k: v[0] for k, v in spec.grid.items() if v}}
            resolve_params(m, {k: v for k, v in given.items() if not k.startswith("phase.")})
        except (TypeError, ValueError) as e:  # TypeError: int([1, 2]), a wrong kind
            raise ValidationError(f"config.methods[{spec.label!r}]: {e}") from None
        role = "baseline" if spec.method in baselines else "other"
        out.append(dataclasses.replace(spec, role=role))
    return out


def _phase_maps(value) -> list[PhaseMapEntry]:
    from brf.fusion import phase_map
    out = []
    for label, (spec, fixed) in config_specs.phase_map_entries(value).items():
        try:
            phase_map(spec)
        except ValueError as e:
            raise ValidationError(f"config.phase_maps[{label!r}] {spec!r}: {e}") from None
        out.append(PhaseMapEntry(label, spec, fixed))
    return out


def _variants(value, where: str) -> tuple[str, ...]:
    names = tuple(_names(value))
    if not names:
        raise ValidationError(f"{where} is empty; give one or more of the method variants "
                              f"{', '.join(VARIANTS)} (comma-separated)")
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise ValidationError(f"{where}: unknown method variant(s) {bad}; "
                              f"use a comma-separated subset of {list(VARIANTS)}")
    return names


def _corpora(value) -> list[Corpus]:
    out = []
    for name, params in parse_list(value, "corpus"):
        bad = sorted(set(params) - set(CORPUS_KEYS))
        if bad:
            raise ValidationError(
                f"corpus {name!r}: unknown parameter(s) {bad}; it takes {list(CORPUS_KEYS)}")
        for key in ("max_chars", "skip_chars"):  # a negative count would act as a slice
            S.integer(0, S.COUNT_MAX, note="0: all" if key == "max_chars" else "").validate(
                params.get(key, 0), f"corpus {name!r}: {key}")
        for key in ("prefix", "label"):
            if not isinstance(params.get(key, ""), str):
                raise ValidationError(f"corpus {name!r}: {key} must be a string (quoted); "
                                      f"got {params[key]!r}")
        label = params.get("label", os.path.basename(name).split(".")[0] or name)
        if not label:
            raise ValidationError(f"corpus {name!r}: label is empty")
        out.append(Corpus(name, label, int(params.get("max_chars", 0)),
                          int(params.get("skip_chars", 0)), params.get("prefix", "")))
    if not out:
        raise ValidationError("config.corpora names no corpus")
    labels = [c.label for c in out]
    if len(set(labels)) != len(labels):
        raise ValidationError(f"config.corpora: duplicate labels {labels}; give each a label=")
    return out


def _sweep(value) -> list[SweepCurve]:
    from brf.fusion import phase_map
    out = []
    for entry in value:
        e = dict(entry)
        try:
            phase_map(e["phase_map"])
        except ValueError as err:
            raise ValidationError(f"config.sweep[{e.get('label')!r}]: {err}") from None
        out.append(SweepCurve(str(e["label"]), str(e["phase_map"]), str(e["param"]),
                              tuple(float(v) for v in e["values"]),
                              dict(e.get("fixed", {}))))
    return out


def split(plan_scoring: ScoringSettings, table, n_segments: int):
    """(calibration, test) tables: the first calibration_fraction of the segments, the
    rest. Raises ValidationError when either has fewer than MIN_SPLIT_POSITIONS."""
    n_cal_seg = max(1, int(round(n_segments * plan_scoring.calibration_fraction)))
    cal_idx = np.nonzero(table.segment < n_cal_seg)[0]
    test_idx = np.nonzero(table.segment >= n_cal_seg)[0]
    for idx, what in ((test_idx, "test"), (cal_idx, "calibration")):
        if len(idx) < MIN_SPLIT_POSITIONS:
            raise ValidationError(
                f"the split leaves {len(idx) or 'no'} {what} positions (fewer than "
                f"{MIN_SPLIT_POSITIONS}; {n_segments} segments, calibration_fraction="
                f"{plan_scoring.calibration_fraction}); use a longer corpus or other "
                f"segment sizes")
    return table.take(cal_idx), table.take(test_idx)


def calibration_segments(plan_scoring: ScoringSettings, n_segments: int) -> int:
    """How many leading segments form the calibration split."""
    return max(1, int(round(n_segments * plan_scoring.calibration_fraction)))
