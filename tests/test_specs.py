"""brf.specs: the text grammar that configs and flags use to name things."""

import math
import re

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
    from brf.fusion import phase_map
    with pytest.raises(SpecError, match="too large a number"):
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
