"""Prompts, one rule for every source (issue 71).

A prompt is a string of valid UTF-8 text, not empty and not only whitespace;
nothing is skipped, so prompt i is output row i. The rule is walked over every
source a prompt comes from -- generate's ``config.prompts`` (a tuple),
dump_logits' ``config.prompts`` (one a line), a prompts file's lines, a JSONL
line's ``"prompt"``, and the Python API (`brf.ensemble.generate` / `stream`,
`brf.eval.dump.dump_generations`) -- with every kind of bad prompt, each refused
naming where it is (`EnsembleInputError`, one line in a main), before any model runs.
"""

from __future__ import annotations

import json
import types

import ml_collections
import pytest

from brf.ensemble import EnsembleInputError, generate, stream
from brf.ensemble.member import check_prompts
from brf.ensemble.run import read_prompts
from brf.eval import dump

# kind -> (the value, the words the refusal holds)
BAD = {
    "empty": ("", "is empty"),
    "whitespace": (" \t ", "only whitespace"),
    "not UTF-8": ("caf\udcc3", "not valid UTF-8"),
    "None": (None, "must be a string"),
    "bytes": (b"hello", "must be a string"),
    "number": (3, "must be a string"),
    "list": (["a"], "must be a string"),
}
TEXT_KINDS = ("empty", "whitespace", "not UTF-8")  # what a line of text can hold


def _dump_model():
    return types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=8), tokenizer=None,
                                 params=None)


def _sequence_sources():
    """name -> (call with a list of prompts, how the refusal names prompt 2)."""
    return {
        "generate config.prompts": (lambda ps: read_prompts(tuple(ps)),
                                    "config.prompts: prompt 2"),
        "brf.ensemble.generate": (lambda ps: generate([], ps), "prompts: prompt 2"),
        "brf.ensemble.stream": (lambda ps: stream([], ps), "prompts: prompt 2"),
        "dump_generations": (lambda ps: dump.dump_generations(_dump_model(), ps, "x.csv"),
                             "prompts: prompt 2"),
    }


def _line_sources(tmp_path):
    """name -> (call with the lines of text, how the refusal names line 2)."""
    def file(lines, jsonl=False):
        path = tmp_path / ("p.jsonl" if jsonl else "p.txt")
        body = "\n".join(json.dumps({"prompt": x}) if jsonl else x for x in lines) + "\n"
        path.write_bytes(body.encode("utf-8", "surrogateescape"))
        return str(path)

    def dumped(lines):
        c = ml_collections.ConfigDict(dict(prompts="\n".join(lines), prompts_file=""))
        return dump._prompts(c)
    return {
        "dump_logits config.prompts": (dumped, "config.prompts, line 2"),
        "prompts file": (lambda ls: read_prompts(("x",), file(ls)), "p.txt, line 2"),
        "JSONL file": (lambda ls: read_prompts(("x",), file(ls, jsonl=True)),
                       "p.jsonl, line 2: 'prompt'"),
        "dump_logits prompts file": (
            lambda ls: dump._prompts(ml_collections.ConfigDict(
                dict(prompts="x", prompts_file=file(ls)))), "p.txt, line 2"),
    }


@pytest.mark.parametrize("kind", sorted(BAD))
def test_every_sequence_source_refuses_every_bad_prompt(kind):
    value, words = BAD[kind]
    for source, (call, where) in _sequence_sources().items():
        with pytest.raises(EnsembleInputError) as e:
            call(["fine", value, "also fine"])
        assert where in str(e.value) and words in str(e.value), (source, str(e.value))


@pytest.mark.parametrize("kind", TEXT_KINDS)
def test_every_text_source_refuses_every_bad_line(kind, tmp_path):
    """A blank line is a prompt that breaks the rule, as "" in a tuple is: it used to be
    skipped in files (rows renumbered) and generated from in JSONL."""
    value, words = BAD[kind]
    for source, (call, where) in _line_sources(tmp_path).items():
        if kind == "not UTF-8" and source in ("prompts file", "dump_logits prompts file"):
            words_here = "cannot read"  # the file's bytes are not UTF-8
        else:
            words_here = words
        with pytest.raises(EnsembleInputError) as e:
            call(["fine", value, "also fine"])
        message = str(e.value)
        assert words_here in message, (source, message)
        if words_here == words:
            assert where in message, (source, message)


def test_json_lines_whose_prompt_is_not_a_string_are_refused(tmp_path):
    for value in (None, 3, ["a"], {"a": 1}):
        path = tmp_path / "p.jsonl"
        path.write_text('{"prompt": "ok"}\n' + json.dumps({"prompt": value}) + "\n")
        with pytest.raises(EnsembleInputError, match=r"p.jsonl, line 2: 'prompt' must be a "
                                                     "string"):
            read_prompts((), str(path))


def test_rows_match_the_input_in_every_source(tmp_path):
    """Valid prompts come back as given, in order, one each: prompt i is row i."""
    prompts = ["first", "  second with spaces  ", "<|im_start|> third", "fourth"]
    assert read_prompts(tuple(prompts)) == check_prompts(prompts) == prompts
    for source, (call, _) in _line_sources(tmp_path).items():
        assert call(prompts) == prompts, source


def test_one_string_is_one_prompt():
    """brf.ensemble.generate(members, "hello") ran five prompts, one per letter."""
    assert check_prompts("hello") == ["hello"]
    assert read_prompts("hello") == ["hello"]
    for bad in (None, 3, b"hello", {"prompt": "x"}):
        with pytest.raises(EnsembleInputError, match="must be a string or a list"):
            check_prompts(bad)
    with pytest.raises(EnsembleInputError, match="no prompts"):
        check_prompts([])


def test_generate_with_one_string_generates_one_text(pair):
    out = generate(pair, "hello", max_new_tokens=2, sampler="greedy")
    assert [g.prompt for g in out] == ["hello"]
