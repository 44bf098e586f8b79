"""brf.specs: the text grammar that configs and flags use to name things."""

import math
import re

import numpy as np
import pytest

from brf.specs import SpecError, format_spec, parse_list, parse_spec, split_list


def test_names_with_dashes_paths_and_no_arguments():
    assert parse_spec("smollm2-135m-instruct") == ("smollm2-135m-instruct", {})
    assert parse_spec(" /tmp/m odel.gguf ") == ("/tmp/m odel.gguf", {})
    assert parse_spec("linear()") == ("linear", {})


def test_literal_values_arithmetic_and_nested_specs():
    name, p = parse_spec('born(phase=tanh(rate=0.5, offset=[0, pi/2]), z_min=1e-3, '
                         'flag=True, label="a, b (c)", w=[0.25, -0.5], none=None)')
    assert name == "born"
    assert p["phase"] == "tanh(rate=0.5, offset=[0, pi/2])"
    assert p["z_min"] == 1e-3 and p["flag"] is True and p["none"] is None
    assert p["label"] == "a, b (c)" and p["w"] == [0.25, -0.5]
    assert parse_spec("x(a=2*pi)")[1]["a"] == pytest.approx(2 * math.pi)


def test_lists_split_at_top_level_commas_only():
    text = 'smollm2-135m-instruct(prefix="Hi, there (friend)"), gemma3-270m, loglinear(w=[1, 2])'
    assert split_list(text) == ['smollm2-135m-instruct(prefix="Hi, there (friend)")',
                                "gemma3-270m", "loglinear(w=[1, 2])"]
    out = parse_list(text, "member")
    assert out[0] == ("smollm2-135m-instruct", {"prefix": "Hi, there (friend)"})
    assert out[2] == ("loglinear", {"w": [1, 2]})
    assert parse_list(["a", {"name": "b", "k": 1}]) == [("a", {}), ("b", {"k": 1})]


@pytest.mark.parametrize("bad", ["", "(x=1)", "f(1)", "f(x=1", "f(x=a.b)", "f(x={1: 2})",
                                 "f(x='unterminated)", "f(x=1))", "f(x=[1)", "f(**d)"])
def test_bad_specs_raise_one_clear_error(bad):
    with pytest.raises(SpecError):
        parse_spec(bad, "method")


def test_format_round_trips():
    spec = format_spec("loglinear", {"temperature": 0.8, "label": "x"})
    assert parse_spec(spec) == ("loglinear", {"temperature": 0.8, "label": "x"})


def test_line_breaks_inside_quoted_values_are_kept():
    text = 'gemma3-270m(template="<start_of_turn>user\n{prompt}<end_of_turn>\n")'
    assert parse_spec(text)[1]["template"] == "<start_of_turn>user\n{prompt}<end_of_turn>\n"
    with pytest.raises(SpecError):
        parse_spec("f(a=1\n b)")


@pytest.mark.parametrize("text,what,key", [
    ('born(phase="tanh", phase="linear")', "method", "phase"),
    ('linear(label="a", label="b")', "method", "label"),
    ("smollm2-135m-instruct(weight=0.5, weight=0.5)", "member", "weight"),
    ("born(phase=tanh(rate=1, rate=2))", "method", "rate"),  # nested: when it is read
])
def test_a_key_given_twice_is_refused_by_name(text, what, key):
    """Issue 37: the last value used to win silently, for every spec kind."""
    from brf.fusion import FusionInputError, phase_map
    if "tanh(" in text:  # a nested phase map is kept as text and read by brf.fusion.phase
        nested = parse_spec(text, what)[1]["phase"]
        with pytest.raises(FusionInputError, match=f"{key!r} is given twice"):
            phase_map(nested)
        return
    with pytest.raises(SpecError, match=f"{what} spec .*: {key!r} is given twice"):
        parse_spec(text, what)
    with pytest.raises(SpecError, match=f"{key!r} is given twice"):
        parse_list(f"other, {text}", what)


def test_a_marker_call_with_a_key_given_twice_is_refused():
    from brf.specs import parse_call
    assert parse_call('grid("a", k=1)') == ("grid", ["a"], {"k": 1})
    with pytest.raises(SpecError, match="'k' is given twice"):
        parse_call("fit(1.0, k=1, k=2)")


@pytest.mark.parametrize("text,needle", [
    ("ngram(n=2, k=9**9**9)", "'9**9**9' is too large a number"),  # hung before issue 54
    ("a(x=2**1025)", "more than 1024 bits"),
    ("a(x=10**300*10**300*10**300)", "too large a number"),
    ("a(x=9.0**9**9)", "beyond float range"),
    ("a(x=1e999)", "'1e999' is not a finite number"),
    ("a(x=[0, -1e999])", "'1e999' is not a finite number"),
    ("a(x=1/0)", "divides by zero"),
    ("a(x=(-8)**0.5)", "is not a real number"),
])
def test_arithmetic_is_bounded_and_finite(text, needle):
    """Issue 54: `**` was evaluated without bound (9**9**9 ran for hours before
    anything loaded) and 1e999 became inf, which methods then accepted. Values are
    finite numbers of at most 1024 bits; the bound is checked before a power is
    computed."""
    import time
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match=re.escape(needle)):
        parse_spec(text)
    assert time.perf_counter() - t0 < 5  # refused, not computed
    assert parse_spec("a(x=2**1000, y=-pi/2)")[1] == {"x": 2**1000, "y": -math.pi / 2}


def test_a_phase_map_bounds_its_arithmetic_too():
    from brf.fusion import FusionInputError, phase_map
    with pytest.raises(FusionInputError, match="too large a number"):  # issue 71, item 4
        phase_map("tanh(rate=9**9**9)")
    assert float(phase_map("tanh(rate=2**-2)").params["rate"]) == 0.25


@pytest.mark.parametrize("params", [dict(temperature=math.inf), dict(temperature=math.nan),
                                    dict(temperature=1e400)])
def test_a_method_refuses_a_non_finite_parameter(params):
    """Issue 54: loglinear(temperature=1e999) was accepted (positive() let inf pass)."""
    import numpy as np

    import brf
    from brf.fusion import FusionInputError
    logits = np.log(np.array([[[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]], np.float32))
    with pytest.raises(FusionInputError, match="temperature=.* must be finite"):
        brf.fuse("loglinear", logits, None, **params)
    assert np.isfinite(np.asarray(brf.fuse("loglinear", logits, None, temperature=1e30))).all()


# ------------------------------------------------------------- every field of every grammar

# The bad values of issue 71 (item 3), as a user types them into a spec: a zero, a
# negative, a huge number, NaN, infinity and values of the wrong type.
BAD = {"zero": "0", "negative": "-1", "huge": "10**12", "nan": "nan", "inf": "inf",
       "inf literal": "1e999", "text": "'x'", "list": "[1, 2]", "bool": "True"}
# Brf's own grammars, field by field: the bad values each accepts (a zero meaning
# "off" or "the first", a text field's text); every other one is refused.
OWN = {
    "drafter member(k)": ({"member(k={})"}, set()),
    "drafter member(index)": ({"member(index={})"}, {"zero", "huge"}),  # vs. the members
    "drafter member(adaptive)": ({"member(adaptive={})"}, {"bool"}),
    "drafter member(cost)": ({"member(cost={})"}, {"zero"}),
    "drafter ngram(k)": ({"ngram(k={})"}, set()),
    "drafter ngram(n)": ({"ngram(n={})", "ngram(min_n=1, n={})"}, {"huge"}),
    "drafter ngram(min_n)": ({"ngram(n=3, min_n={})"}, set()),
    "drafter ngram(adaptive)": ({"ngram(adaptive={})"}, {"bool"}),
    "drafter ngram(cost)": ({"ngram(cost={})"}, {"zero"}),
    "weighting(temperature)": ({"perplexity(temperature={})"}, {"huge"}),  # uniform
    "member(weight)": ({"smollm2-135m-instruct(weight={})"}, {"zero", "huge"}),
    "member(prefix)": ({"smollm2-135m-instruct(prefix={})"}, {"text"}),
    "member(name)": ({"smollm2-135m-instruct(name={})"}, {"text"}),
    "member(chat)": ({"smollm2-135m-instruct(chat={})"}, {"bool"}),
    "member(template)": ({"smollm2-135m-instruct(template={})"}, set()),
    "study member(prefix)": ({"smollm2-135m-instruct(prefix={})"}, {"text"}),
    "corpus(max_chars)": ({"c.txt(max_chars={})"}, {"zero"}),
    "corpus(skip_chars)": ({"c.txt(skip_chars={})"}, {"zero"}),
    "corpus(prefix)": ({"c.txt(prefix={})"}, {"text"}),
    "corpus(label)": ({"c.txt(label={})"}, {"text"}),
    "sampler(temperature)": ({"temperature={}"}, {"zero"}),  # (10**12: not a number
    "sampler(top_k)": ({"top_k={}"}, {"zero"}),  # in its key=number grammar)
    "sampler(top_p)": ({"top_p={}"}, set()),
    "sampler(min_p)": ({"min_p={}"}, {"zero"}),
}


def _boundary(grammar: str):
    """What a main runs on the spec before any model loads: the generation config's
    key (its schema check, which names the key and the value) or the study plan's."""
    from brf.ensemble import run
    from brf.eval import plan
    kind = grammar.split("(")[0]
    key = {"drafter member": "speculative", "drafter ngram": "speculative",
           "weighting": "weighting", "member": "members", "sampler": "sampler",
           "method": "method", "phase": "phase"}.get(kind)
    if key:
        return lambda text: run.SCHEMA[key].validate(text, f"config.{key}")
    return {"study member": plan._members, "corpus": plan._corpora,
            "study method": lambda t: plan._methods(t, ()),
            "study phase map": plan._phase_maps}[kind]


def _outcome(check, text: str) -> str | None:
    """None when accepted; else the refusal's message (a UserError, one line), within
    a few seconds (a hang fails)."""
    import signal

    from brf.errors import UserError

    def hang(*_):
        raise AssertionError(f"{text!r} was still being checked after 10 s")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    try:
        check(text)
        return None
    except UserError as e:
        msg = str(e)
        assert "\n" not in msg, msg
        return msg
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("grammar", OWN)
@pytest.mark.parametrize("bad", BAD)
def test_every_field_of_brfs_own_grammars_is_bounded(grammar, bad):
    """Issue 71: ngram(n=3, k=1000000000000) hung. Each field of each of brf's own spec
    grammars (drafters, weightings, members, corpora, samplers) with each bad value is
    refused as one line naming the field, or is one the table accepts."""
    forms, accepted = OWN[grammar]
    field = grammar[grammar.index("(") + 1:-1]
    for form in forms:
        text = form.format(BAD[bad])
        msg = _outcome(_boundary(grammar), text)
        if bad in accepted:
            assert msg is None, (text, msg)
        else:
            assert msg is not None, f"{text!r} was accepted"
            assert field in msg, (text, msg)


def _fusion_fields():
    from brf.fusion import METHODS
    from brf.fusion.phase import PHASE_MAPS
    out = []
    for name in METHODS.names():
        for field, p in METHODS.get(name).params.items():
            if p.kind != "array":
                out += [("method", f"{name}({field}={{}})", field),
                        ("study method", f"{name}({field}={{}})", field)]
    for name in PHASE_MAPS.names():
        for field in [*PHASE_MAPS.get(name).defaults, "offset"]:
            out += [("phase", f"{name}({field}={{}})", field),
                    ("study phase map", f"{name}({field}={{}})", field)]
    return out


@pytest.mark.parametrize("bad", BAD)
def test_every_field_of_every_method_and_phase_map_is_checked(bad):
    """Every parameter of every fusion method and phase map, at the generation config
    and the study plan: a bad value is refused as one line naming it, never a raw
    TypeError / ValueError (born_shuffled(seed='x') was one) nor a hang, and NaN,
    infinity and text are always refused. (Which numbers a method takes is its own
    rule, brf/fusion: this walks what reaches the user.)"""
    for kind, form, field in _fusion_fields():
        text = form.format(BAD[bad])
        msg = _outcome(_boundary(kind), text)
        if bad in ("nan", "inf", "inf literal", "text") and not (
                field == "inner" or (kind.endswith("method") and field == "criterion")):
            assert msg is not None, f"{kind} {text!r} was accepted"
        if msg is not None:
            assert field in msg, (kind, text, msg)


def test_a_drafters_k_is_bounded_by_what_a_round_can_use():
    """Issue 71: ngram(n=3, k=1000000000000) and k=100000 hung. k is at most
    brf.drafting.MAX_K, and a generation drafts at most max_new_tokens (max_bytes)
    a round: the schedule of a k above that is that of max_new_tokens."""
    from brf.drafting import MAX_K, DrafterError, KSchedule, parse_drafter
    for k in (10**12, 100000, MAX_K + 1):
        with pytest.raises(DrafterError, match=f"k must be an integer <= {MAX_K}"):
            parse_drafter(f"ngram(n=3, k={k})")
    spec = parse_drafter(f"ngram(n=3, k={MAX_K})")
    assert spec.within(8).k == 8 and spec.within(10**6).k == MAX_K
    assert parse_drafter("ngram(k=6)").within(0).k == 1
    wide, narrow = KSchedule(spec.within(8)), KSchedule(parse_drafter("ngram(n=3, k=8)"))
    assert (wide.k, wide.size, wide.can_pay) == (narrow.k, narrow.size, narrow.can_pay)


# The Python API's bad values (issue 71): what code hands brf.fusion.compile, beyond
# what a spec string can spell: NumPy scalars and arrays, bools, None, huge ints.
API_BAD = {"numpy inf": np.float32("inf"), "numpy nan array": np.array([np.nan]),
           "bool": True, "none": None, "huge float": 1e300, "huge int": 2**70,
           "text": "x"}


def test_every_parameter_of_the_python_api_is_checked():
    """Issue 71: loglinear(temperature=np.float32('inf')) and a phase map
    {'name': 'tanh', 'scale': True} were accepted, born_shuffled(seed=1e300) raised a
    raw OverflowError and bottleneck max_iters=10**12 ran on. Through brf.fusion.compile
    every parameter of every method and phase map with each bad value is refused as a
    FusionInputError naming it, or accepted only where the value is one the parameter
    takes (a text for a text field)."""
    from brf.fusion import METHODS, FusionInputError, compile as compile_method
    from brf.fusion.phase import PHASE_MAPS
    U = [np.zeros((8, 2), np.float32)] * 2
    for name in METHODS.names():
        for field, p in METHODS.get(name).params.items():
            if p.kind in ("array", "params"):
                continue
            for bad, value in API_BAD.items():
                extra = {"unembeddings": U} if "unembeddings" in METHODS.get(name).params else {}
                try:
                    compile_method(name, **extra, **{field: value})
                except FusionInputError as e:
                    assert field in str(e) or p.kind in ("phase", "method"), (name, field, e)
                    continue
                assert (p.kind in ("str", "method") and bad == "text") or (
                    p.kind in ("float", "floats") and bad == "huge int"), (name, field, bad)
    for name in PHASE_MAPS.names():
        for field in [*PHASE_MAPS.get(name).defaults, "offset"]:
            for bad, value in API_BAD.items():
                if bad in ("text", "huge int"):  # 2**70 is a finite float32
                    continue
                with pytest.raises(FusionInputError, match=field):
                    compile_method("born", phase={"name": name, field: value})
    with pytest.raises(FusionInputError, match="max_iters"):
        compile_method("bottleneck_lsq", unembeddings=U, max_iters=10**12)
    with pytest.raises(FusionInputError, match=r"seed.*2\^32"):
        compile_method("born_shuffled", seed=2**32)
    compile_method("born_shuffled", seed=2**32 - 1)
