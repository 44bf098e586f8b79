"""Every config file parses, and names only registered methods and phase maps."""

import importlib.util
import pathlib

import pytest

from brf.eval.config_specs import method_entries, phase_map_entries
from brf.fusion import get_method, phase_map
from brf.specs import parse_spec

CONFIGS = sorted(pathlib.Path(__file__).parent.parent.joinpath("configs").glob("*.py"))


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_and_names_registered_things(path):
    mod = _load(path)
    doc = mod.__doc__ or ""
    assert f"--config=configs/{path.name}" in doc, "the docstring shows the run command"
    cfg = mod.get_config()
    for row in cfg.get("rows", []):
        get_method(row["method"])
        if "phase" in row:
            phase_map(row["phase"])
    for spec in method_entries(cfg.get("methods", [])):
        get_method(spec.method)
        if spec.phase:
            phase_map(spec.phase)
    if "method" in cfg:  # a single method spec (generate.py)
        get_method(parse_spec(cfg.method, "method")[0])
    if cfg.get("phase"):
        phase_map(cfg.phase)
    for spec, _ in phase_map_entries(cfg.get("phase_maps", "")).values():
        phase_map(spec)


def test_demo_main_prints_every_method(capsys):
    from brf.eval.tables import fusion_table
    cfg = _load(CONFIGS[[p.stem for p in CONFIGS].index("demo")]).get_config()
    table = fusion_table(cfg.logits, cfg.tokens, cfg.rows, weights=cfg.weights)
    for row in cfg.rows:
        assert row["label"] in table
    assert "below every member" in table  # the interference is visible


@pytest.mark.parametrize("arg", [None, "full", "short"])
def test_validation_config_makes_a_plan(arg):
    """The study's config (the main job, full and short) becomes a checked plan: members,
    corpora, every method in both variants, and the analyses of each corpus. The main job
    keeps what answers the paper's tests (three corpora, the swarm, both levels, a
    per-token map for the controls, the pools) and leaves the top-256 check, the
    same-model pair and the other phase maps to ':full'."""
    from brf.eval import plan as plan_lib
    mod = _load(CONFIGS[[p.stem for p in CONFIGS].index("validate")])
    plan = plan_lib.from_config(mod.get_config(arg))
    assert len(plan.members) == 2 and plan.variants == ("proposed", "calibrated")
    specs = plan.method_specs(2)
    assert len({s.label for s in specs}) == len(specs)
    assert {s.role for s in specs} == {"brf", "baseline", "member", "other"}
    kinds = [a.kind for a in plan.analyses(0)]
    main = arg is None
    assert kinds == (["corpus", "prefix", "swarm"] if main else
                     ["corpus", "topk", "prefix", "same_model", "swarm"])
    assert len(plan.corpora) == (1 if arg == "short" else 3)
    maps = {e.label for e in plan.phase_maps}
    assert ({"hellinger (equal phases)", "linear pool (pi/2)", "token_tanh", "tanh"} <= maps
            and len(maps) == (5 if main else 11))
    assert {s.role for s in plan.method_specs(2)} >= {"brf", "baseline"}
    assert {a.level for a in plan.analyses(0)} == {"tokens"}
    # The study on every byte: the same kinds but the event-space check (off in CI's
    # short run, whose real models would take too long).
    assert plan.bytes.beam >= 1 and 0 <= plan.bytes.threshold < 1
    byte_level = plan.analyses(0, "bytes")
    if arg == "short":
        assert not plan.bytes.enabled and byte_level == []
    else:
        assert plan.bytes.enabled
        # The main job reads a span of each corpus at the byte level, without the
        # prompt study (configs/validate.py: every byte of everything is hours).
        assert plan.bytes.max_chars > 0 and not plan.bytes.prompts
        assert [a.kind for a in byte_level] == ["corpus"]
        cfg = mod.get_config(arg)
        cfg.bytes.prompts = True
        full = plan_lib.from_config(cfg).analyses(0, "bytes")
        assert [a.kind for a in full] == [k for k in kinds if k != "topk"]
        assert {a.level for a in full} == {"bytes"} and {a.top_k for a in full} == {0}
        assert [a.members for a in full] == [a.members for a in plan.analyses(0)
                                             if a.kind != "topk"]
        # bytes.swarm=False leaves the swarm out on bytes only.
        cfg.bytes.swarm = False
        off = plan_lib.from_config(cfg)
        assert [a.kind for a in off.analyses(0, "bytes")] == [
            k for k in kinds if k not in ("topk", "swarm")]
        assert [a.kind for a in off.analyses(0)] == kinds
    # The linear-pool reference (one offset per member) has no four-member form.
    assert len(plan.phase_maps_for(4)) == len(plan.phase_maps) - 1


def test_byte_defaults_live_in_brf_bytes(monkeypatch):
    """Issue 37: the plan's ByteSettings defaulted to max_lag=0 (and a config without
    beam/threshold failed) while brf.bytes and configs/validate.py said 2, and
    configs/generate.py's byte-level threshold was its own 1e-3. All read
    brf.bytes' DEFAULT_BEAM / DEFAULT_THRESHOLD / DEFAULT_MAX_LAG now."""
    import ml_collections

    import brf.bytes
    from brf.eval import plan as plan_lib
    lib = (brf.bytes.DEFAULT_BEAM, brf.bytes.DEFAULT_THRESHOLD, brf.bytes.DEFAULT_MAX_LAG)

    def settings(b):
        return (b.beam, b.threshold, b.max_lag)

    assert settings(plan_lib.ByteSettings(True)) == lib
    validate = _load(CONFIGS[[p.stem for p in CONFIGS].index("validate")])
    cfg = validate.get_config()
    assert settings(plan_lib.from_config(cfg).bytes) == lib
    cfg.bytes = ml_collections.ConfigDict(dict(enabled=True))  # none of the keys
    assert plan_lib.from_config(cfg).bytes == plan_lib.ByteSettings(True)
    generate = _load(CONFIGS[[p.stem for p in CONFIGS].index("generate")])
    assert (generate.get_config("bytes").beam, generate.get_config("bytes").threshold) == lib[:2]
    # ... read from brf.bytes, not numbers that happen to agree today.
    monkeypatch.setattr(brf.bytes, "DEFAULT_BEAM", 5)
    monkeypatch.setattr(brf.bytes, "DEFAULT_THRESHOLD", 0.25)
    monkeypatch.setattr(brf.bytes, "DEFAULT_MAX_LAG", 7)
    b = _load(CONFIGS[[p.stem for p in CONFIGS].index("validate")]).get_config().bytes
    assert (b.beam, b.threshold, b.max_lag) == (5, 0.25, 7)
    g = _load(CONFIGS[[p.stem for p in CONFIGS].index("generate")]).get_config("bytes")
    assert (g.beam, g.threshold) == (5, 0.25)


@pytest.mark.parametrize("calib_range", [0.5, 1.0, -3.0])
def test_a_calibration_box_that_is_not_a_box_is_refused(calib_range):
    """fit.calib_range is 0 (unbounded) or > 1; anything else names the key."""
    from brf.eval import plan as plan_lib
    mod = _load(CONFIGS[[p.stem for p in CONFIGS].index("validate")])
    cfg = mod.get_config("short")
    cfg.fit.calib_range = calib_range
    with pytest.raises(plan_lib.ValidationError, match="fit.calib_range"):
        plan_lib.from_config(cfg)
    cfg.fit.calib_range = 0.0
    assert plan_lib.from_config(cfg).fit.calib_range == 0.0


def test_byte_level_span_is_whole_segments_and_checked():
    """config.bytes.max_chars: the byte level reads the corpus's first whole segments
    up to that many characters, never fewer than two (a calibration and a test
    split), hashed as what it holds; the token level reads all of them. A bad value
    is named."""
    import hashlib

    from brf.eval import plan as plan_lib
    from brf.eval.levels import ByteLevel, LoadedCorpus, TokenLevel
    segments = ["a" * 10, "b" * 10, "c" * 10, "d" * 5]
    text = "".join(segments)
    whole = LoadedCorpus.of(plan_lib.Corpus("x", "x"), segments, "src", "lic")
    assert (whole.chars, whole.sha256) == (len(text), hashlib.sha256(text.encode()).hexdigest())
    for max_chars, n in ((0, 4), (35, 4), (1000, 4), (34, 3), (30, 3), (29, 2), (1, 2)):
        head = whole.head(max_chars)
        assert head.segments == segments[:n], max_chars
        part = "".join(segments[:n])
        assert (head.chars, head.sha256) == (len(part), hashlib.sha256(part.encode()).hexdigest())
    validate = _load(CONFIGS[[p.stem for p in CONFIGS].index("validate")])
    cfg = validate.get_config()
    cfg.bytes.max_chars = 25
    plan = plan_lib.from_config(cfg)
    assert ByteLevel(plan).span(whole).segments == segments[:2]
    assert TokenLevel(plan).span(whole) is whole
    for key, bad in (("max_chars", -1), ("max_chars", 2.5), ("max_chars", True),
                     ("prompts", "yes"), ("swarm", 1)):
        cfg = validate.get_config()
        del cfg.bytes[key]  # ConfigDict keeps a field's type; a flag's string comes as is
        cfg.bytes[key] = bad
        with pytest.raises(plan_lib.ValidationError, match=f"config.bytes.{key}"):
            plan_lib.from_config(cfg)
