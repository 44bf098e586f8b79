"""Every key of every config in configs/ is checked at the boundary (issue 54).

For each config family the boundary is what its main runs before any model loads
(the study's plan, the generation request, the dump up to loading its model, the CSV
analysis's and the demo's checks). Each key gets the bad values of its kind: a wrong
type, a negative, a zero, a non-finite float, a huge value, an empty or unknown name.
The table below says which of them a key accepts (a zero meaning "off", -1 meaning
"every device", an empty string meaning "none"); every other one must be refused as a
user error naming the key. The table lists every key of every config file (with
every config argument): a key added to a config without a row here fails the test.
"""

import importlib.util
import math
import pathlib

import ml_collections
import pytest

from brf.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _config_module(name):
    spec = importlib.util.spec_from_file_location(f"{name}_config", ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _WouldLoad(Exception):
    """The dump reached its model: every check before it passed."""


def _validate(cfg):
    from brf.eval import plan
    plan.from_config(cfg)


def _generate(cfg):
    from brf.ensemble.run import Request
    Request.from_config(cfg)


def _dump(cfg, monkeypatch):
    from brf.eval import dump

    def load(*a, **k):
        raise _WouldLoad

    monkeypatch.setattr(dump, "load_model", load)
    monkeypatch.setattr(dump, "_score_text", lambda c: "text")  # the corpus: test_corpus
    try:
        dump.run(cfg)
    except _WouldLoad:
        pass


def _analyze(cfg):
    from brf.eval import csv_analysis
    csv_analysis.check_config(cfg)


def _demo(cfg):
    from brf.eval import tables
    tables.check_config(cfg)


# family -> (config arguments whose keys are listed, base argument, base overrides,
# boundary)
FAMILIES = {
    "validate": ([None, "short"], "short", {}, _validate),
    "generate": ([None, "tiny", "bytes", "me", "prompts"], "tiny", {}, _generate),
    "dump_logits": ([None, "tiny", "generate"], "tiny", {"compilation_cache": False}, _dump),
    "analyze_csv": ([None, "tiny"], "tiny", {"csvs": "a.csv,b.csv"}, _analyze),
    "demo": ([None], None, {}, _demo),
}

# The probes of each kind of key (its default value's type).
PROBES = {
    "int": {"wrong": "x", "float": 1.5, "neg": -1, "zero": 0, "huge": 10**30},
    "float": {"wrong": "x", "neg": -1.0, "zero": 0.0, "nan": math.nan, "inf": math.inf,
              "huge": 1e300},
    "bool": {"wrong": "x", "int": 1},
    "str": {"wrong": 123, "empty": "", "name": "nope"},
    "strs": {"wrong": 123, "item": (123,), "empty": ()},
    "numbers": {"wrong": "x", "item": ("x",), "nan": (math.nan,)},
    "rows": {"wrong": "x", "item": ["x"]},
    "mapping": {"wrong": "x"},
}

# family -> key -> the probes it accepts (space-separated); all others are refused.
# "str" keys also accept their own default (not probed).
ACCEPTS = {
    "validate": {
        "members": "", "corpora": "", "out_dir": "name", "variants": "", "methods": "",
        "nll_baselines": "", "controls": "", "phase_maps": "", "sweep": "",
        "scoring.segment_chars": "", "scoring.top_k": "", "scoring.chunk": "",
        "scoring.min_chars": "zero", "scoring.calibration_fraction": "",
        "fit.max_iter": "", "fit.ftol": "", "fit.gtol": "", "fit.calib_range": "zero huge",
        "fit.param_range": "zero huge", "fit.starts": "zero", "fit.perturb": "empty",
        "stability": "empty", "stability_reach": "zero huge",
        "stats.n_boot": "", "stats.n_perm": "", "stats.seed": "zero",
        "stats.forking_top_fraction": "",
        "prompts.enabled": "", "prompts.second_prefix": "empty name", "prompts.swarm": "",
        "prompts.variants": "empty",
        "bottleneck.positions": "zero", "bottleneck.top_k": "zero", "topk_sensitivity": "zero",
        "bytes.enabled": "", "bytes.beam": "", "bytes.threshold": "zero",
        "bytes.max_lag": "zero", "bytes.swarm": "", "bytes.check_bytes": "zero",
        "bytes.reference_beam": "", "bytes.reference_threshold": "zero",
        "bytes.max_chars": "zero", "bytes.prompts": "",
        "compilation_cache": "", "compilation_cache_dir": "empty name",
        "mesh.data": "neg", "mesh.model": "neg", "mesh.placement": "",
        "distributed.enabled": "", "distributed.coordinator_address": "empty name",
        "distributed.num_processes": "zero", "distributed.process_id": "neg zero",
    },
    "generate": {
        "members": "", "aligner": "", "aligner_params.k": "", "mode": "", "method": "",
        "phase": "empty", "method_params": "", "weighting": "empty", "sampler": "empty",
        "choice": "", "max_new_tokens": "", "stop": "empty", "seed": "zero", "dtype": "",
        "prompts": "", "prompts_file": "empty", "output": "empty name", "stream": "",
        "compilation_cache": "", "engine": "",
        "level": "", "speculative": "empty", "beam": "", "threshold": "zero",
        "max_new_bytes": "", "utf8": "", "check_precision": "",
        "mesh.data": "neg", "mesh.model": "neg", "mesh.placement": "",
    },
    "dump_logits": {
        "model": "", "mode": "", "output": "empty name", "overwrite": "", "k": "",
        "system": "empty name", "prefix": "empty name", "text": "empty name",
        "text_file": "empty", "max_chars": "zero", "max_positions": "zero",
        "segment_tokens": "", "chunk": "", "prompts": "empty name", "prompts_file": "empty",
        "chat": "", "template": "empty", "sampler": "empty", "max_new_tokens": "",
        "seed": "zero", "compilation_cache": "", "mesh.model": "neg",
    },
    "analyze_csv": {
        "csvs": "", "out_dir": "name", "align": "", "vocab_sizes": "empty",
        "phase_maps": "", "born_phase": "", "fusion_methods": "empty", "n_perm": "",
        "n_boot": "", "seed": "zero",
    },
    "demo": {
        "tokens": "", "member_names": "", "logits": "", "weights": "", "rows": "",
        "cross_terms_phase": "",
    },
}

# Probes beyond the generic ones: (family, key, value, accepted).
EXTRA = [
    ("validate", "members", "smollm2-135m-instruct, smollm2-135m-instruct", False),
    ("validate", "members", 'smollm2-135m-instruct, smollm2-135m-instruct(prefix="Hi. ")',
     True),
    ("validate", "corpora", "hamlet(prefix=123)", False),
    ("validate", "corpora", "hamlet(max_chars=-5)", False),
    ("validate", "methods", "loglinear(temperature=1e999)", False),
    ("validate", "phase_maps", "tanh(rate=9**9**9)", False),
    ("validate", "sweep", [dict(label="t", phase_map="tanh", param="rat", values=[1.0])],
     False),
    ("validate", "sweep", [dict(label="t", phase_map="tanh", param="rate",
                                values=[1.0, math.inf])], False),
    ("generate", "members", "random:smollm2-135m-instruct:0(template='{bogus} {prompt}')",
     False),
    ("generate", "members", "random:smollm2-135m-instruct:0(template='no field')", False),
    ("generate", "members", "random:smollm2-135m-instruct:0(weight=1e999)", False),
    ("generate", "prompts", ("", "hi"), False),
    ("generate", "method", "loglinear(temperature=1e999)", False),
    ("generate", "weighting", "perplexity(temperature=1e999)", False),
    ("generate", "speculative", "ngram(n=2, k=9**9**9)", False),
    ("generate", "stop", ("",), False),
    ("generate", "dtype", "int8", False),
    ("generate", "dtype", "bfloat16", True),
    ("dump_logits", "template", "{bogus} {prompt}", False),
    ("dump_logits", "template", "<turn>{prompt}</turn>", True),
    ("analyze_csv", "fusion_methods", "bottleneck_lsq", False),
    ("analyze_csv", "fusion_methods", "born_shuffled, linear", True),
    ("analyze_csv", "phase_maps", {}, False),
    ("analyze_csv", "phase_maps", {"t": "tanh(rate=nope)"}, False),
    ("analyze_csv", "vocab_sizes", "49152, 1", False),
    ("demo", "tokens", ("a", "b"), False),
    ("demo", "member_names", ("a",), False),
    ("demo", "weights", (0.5, -1.0), False),
    ("demo", "rows", [dict(method="nope")], False),
    ("demo", "rows", [dict(method="loglinear", temperature=math.inf)], False),
]


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if hasattr(value, "items"):
        return "mapping"
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "strs"  # an empty tuple too (generate's stop)
    if isinstance(value, (list, tuple)) and value and hasattr(value[0], "items"):
        return "rows"
    return "numbers"


def _leaves(cfg, prefix=""):
    for k, v in cfg.items():
        # an empty section or a mapping-valued setting is one key (brf.schema.leaves)
        if hasattr(v, "items") and len(v) and k not in ("phase_maps",):
            yield from _leaves(v, prefix + k + ".")
        else:
            yield prefix + k, v


def _all_keys(family):
    mod = _config_module(family)
    keys = {}
    for arg in FAMILIES[family][0]:
        for k, v in _leaves(mod.get_config(arg)):
            keys.setdefault(k, v)
    return keys


def _base(family):
    args, base, over, _ = FAMILIES[family]
    c = ml_collections.ConfigDict(_config_module(family).get_config(base).to_dict(),
                                  type_safe=False)
    for k, v in over.items():
        c[k] = v
    return c


def _set(cfg, key, value):
    *path, last = key.split(".")
    node = cfg
    for p in path:
        node = node[p]
    node[last] = value


def _boundary(family, cfg, monkeypatch):
    fn = FAMILIES[family][3]
    if family == "dump_logits":
        return fn(cfg, monkeypatch)
    return fn(cfg)


def _cases():
    for family in FAMILIES:
        for key, default in sorted(_all_keys(family).items()):
            for probe, value in PROBES[_kind(default)].items():
                accepted = probe in ACCEPTS[family].get(key, "").split()
                yield pytest.param(family, key, value, accepted,
                                   id=f"{family}:{key}={probe}")
    for family, key, value, accepted in EXTRA:
        yield pytest.param(family, key, value, accepted, id=f"{family}:{key}={value!r}"[:80])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_table_lists_every_key_of_every_config(family):
    """A key added to a config file without a row here fails (and the schema refuses
    it too: brf.schema.check names a key it does not know)."""
    assert sorted(_all_keys(family)) == sorted(ACCEPTS[family])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_config_passes_its_own_boundary(family, monkeypatch):
    mod = _config_module(family)
    for arg in FAMILIES[family][0]:
        c = mod.get_config(arg)
        for k, v in FAMILIES[family][2].items():
            c[k] = v
        _boundary(family, c, monkeypatch)


@pytest.mark.parametrize("family,key,value,accepted", list(_cases()))
def test_each_key_refuses_bad_values_by_name(family, key, value, accepted, monkeypatch):
    cfg = _base(family)
    _set(cfg, key, value)
    if accepted:
        _boundary(family, cfg, monkeypatch)
        return
    with pytest.raises(UserError) as e:
        _boundary(family, cfg, monkeypatch)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert f"config.{key}" in msg, msg


def test_a_key_no_schema_knows_is_refused():
    from brf.eval import plan
    cfg = _base("validate")
    cfg.stats.n_boots = 100
    with pytest.raises(UserError, match=r"config\.stats\.n_boots is not a setting"):
        plan.from_config(cfg)
