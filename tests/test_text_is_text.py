"""Text is text: a special token's characters in user text are encoded as characters.

A corpus, a text to dump, a prompt or a prefix that holds ``<|im_start|>``,
``<bos>`` or ``<start_of_turn>`` is read as those characters, never as the
control token; control tokens come only from a chat template, a member's prompt
template and the tokenizer's BOS / EOS rules (brf.align.vocab.encode_text,
encode_template). Every shipped tokenizer (SmolLM2, Gemma 3) and every family
tokenizer (the Qwen-style BPE and the Gemma 2 / Phi-3 SentencePiece ones of
tests/test_family_tokenizers.py, the tiny BPE of tests/tiny_lm.py) reads one
text holding every special string of every one of them, through every place
brf turns user text into ids; the ids decode to exactly the text's bytes. A
walk over brf's and the mains' sources checks that no other place encodes text.
"""

from __future__ import annotations

import ast
import os

import numpy as np
import pytest

from brf.align.reencode import encode_bytes, make_codec
from brf.align.vocab import encode_template, encode_text, encode_texts, token_table
from brf.ensemble.member import Member
from brf.ensemble.packllm import _conditioning_split
from brf.eval import dump, scorer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = ("smollm2-135m-instruct", "gemma3-270m")
GEMMA_TURN = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


def _family_tokenizers(tmp_path):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("torch")
    from test_family_tokenizers import (SPM_FAMILIES, sentencepiece_as_llamacpp_writes,
                                        trained_bpe, trained_sentencepiece)
    from tiny_lm import tiny_tokenizer

    from brf.checkpoints.tokenizer import tokenizer_from_dir, tokenizer_from_gguf
    bpe = trained_bpe()
    bpe.save_pretrained(tmp_path / "qwen2")
    out = {"qwen2-bpe": tokenizer_from_dir(tmp_path / "qwen2"), "tiny-bpe": tiny_tokenizer()}
    for arch in sorted(SPM_FAMILIES):
        sentencepiece_as_llamacpp_writes(trained_sentencepiece(arch), arch,
                                         tmp_path / f"{arch}.gguf")
        out[f"{arch}-sentencepiece"] = tokenizer_from_gguf(tmp_path / f"{arch}.gguf")
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> tokenizer: the two shipped ones (skipped without their packages) and
    every family's."""
    from brf.align.vocab import load_tokenizer
    out = {}
    try:
        for name in SHIPPED:
            out[name] = load_tokenizer(name)
    except FileNotFoundError:
        pass
    out.update(_family_tokenizers(tmp_path_factory.mktemp("families")))
    return out


def _specials(tok) -> list[str]:
    backend = getattr(tok, "backend_tokenizer", tok)
    return sorted(t.content for t in backend.get_added_tokens_decoder().values() if t.special)


@pytest.fixture(scope="module")
def text(tokenizers):
    """Every special string of every tokenizer, between words and glued to them."""
    strings = sorted({s for tok in tokenizers.values() for s in _specials(tok)})
    assert {"<|im_start|>", "<|endoftext|>", "<bos>", "<start_of_turn>", "<s>",
            "<|user|>"} <= set(strings)
    return "Hello " + " ".join(f"w{i}{s}x" if i % 2 else s for i, s in enumerate(strings)) \
        + " end"


def _lead(tok) -> bytes:
    """What the tokenizer puts before every text (a SentencePiece dummy prefix)."""
    got = token_table(tok).decode(encode_text(tok, "a"))
    return got[:-1]


def _no_bos(tok, ids):
    bos = getattr(tok, "bos_token_id", None)
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def _places(tok, text: str):
    """(where, ids, expected bytes) for every place brf turns user text into ids."""
    table = token_table(tok)
    lead = _lead(tok)
    whole = lead + text.encode()
    yield "encode_text", encode_text(tok, text), whole
    yield "encode_texts", encode_texts(tok, ["x", text])[1], whole
    if not lead:  # encode_bytes refuses a dummy prefix (check_reencodable)
        yield "encode_bytes", encode_bytes(make_codec(tok, table), text.encode()), text.encode()
    yield "scorer.encode", _no_bos(tok, [int(i) for i in scorer.encode(
        tok, _Cfg(getattr(tok, "bos_token_id", None)), text)]), whole
    yield "scorer.prefix_ids", scorer.prefix_ids(tok, text), whole
    plain = Member("m", None, None, tok)
    yield "Member.prompt_ids", _no_bos(tok, plain.prompt_ids(text)), whole
    yield "Member.prompt_ids(prefix)", _no_bos(tok, Member("m", None, None, tok, prefix=text)
                                               .prompt_ids("")), whole
    yield "packllm", _no_bos(tok, _conditioning_split(plain, text)[0]), whole
    model = _Model(tok)
    yield "dump.context_ids(prefix)", _no_bos(tok, dump.context_ids(model, prefix=text)), whole


class _Cfg:
    def __init__(self, bos_id):
        self.bos_id = bos_id


class _Model:
    def __init__(self, tok):
        self.tokenizer, self.cfg = tok, _Cfg(getattr(tok, "bos_token_id", None))


def test_every_place_reads_special_strings_as_text(tokenizers, text):
    """Every tokenizer, every place: the ids hold no control token and decode to the
    text's exact bytes."""
    failures = []
    for name, tok in tokenizers.items():
        table = token_table(tok)
        for where, ids, want in _places(tok, text):
            control = [i for i in ids if table.control_V[i]]
            if control or table.decode(ids) != want:
                failures.append(f"{name}: {where}: control ids {control[:5]}")
    assert not failures, failures


def _templated(tok):
    """(where, render, fields, add_special_tokens) for each template a member uses."""
    if getattr(tok, "chat_template", None) is not None:
        yield ("chat", lambda p: Member("m", None, None, tok, chat=True).prompt_ids(p),
               lambda p: tok.apply_chat_template([{"role": "user", "content": p}],
                                                 add_generation_prompt=True, tokenize=False),
               False)
        yield ("chat+system", lambda p: Member("m", None, None, tok, chat=True,
                                               prefix="Be brief.").prompt_ids(p),
               lambda p: tok.apply_chat_template(
                   [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": p}], add_generation_prompt=True,
                   tokenize=False), False)
    yield ("template", lambda p: Member("m", None, None, tok, template=GEMMA_TURN).prompt_ids(p),
           lambda p: GEMMA_TURN.format(prompt=p), True)


def test_templates_keep_their_markers_and_read_the_prompt_as_text(tokenizers, text):
    """A chat template's and a member template's own markers stay control tokens: for
    a prompt without special strings the ids are the tokenizer's own (today's); for the
    text holding them, the ids are the template's with the prompt spelled as text."""
    for name, tok in tokenizers.items():
        table = token_table(tok)
        backend = getattr(tok, "backend_tokenizer", tok)
        for where, ids_of, render, special in _templated(tok):
            plain = "What is 2 + 2?"
            assert ids_of(plain) == list(backend.encode(
                render(plain), add_special_tokens=special).ids), (name, where)
            # The template's control tokens, in order, are those of the plain prompt's.
            got = ids_of(text)
            want_control = [i for i in ids_of(plain) if table.control_V[i]]
            assert [i for i in got if table.control_V[i]] == want_control, (name, where)
            rendered = render("\x00").split("\x00")  # the template's text around the prompt
            assert text.encode() in table.decode(got), (name, where)
            assert table.decode(got) == table.decode(ids_of(plain)).replace(
                plain.encode(), text.encode()), (name, where, rendered)


def test_dump_system_turn_reads_its_text_as_text(tokenizers, text):
    """dump_logits' system prompt goes through the chat template; its text is text."""
    for name, tok in tokenizers.items():
        if getattr(tok, "chat_template", None) is None:
            continue
        table = token_table(tok)
        plain = dump.context_ids(_Model(tok), system="Be brief.")
        got = dump.context_ids(_Model(tok), system=text)
        assert [i for i in got if table.control_V[i]] == \
            [i for i in plain if table.control_V[i]], name
        assert text.encode() in table.decode(got), name


# Calls that turn text into ids. Only brf/align/vocab.py (which reads text as text)
# may make them; everything else calls encode_text / encode_template.
_ENCODERS = {"encode", "encode_batch", "apply_chat_template", "__call__"}
_TOKENIZER_NAMES = {"tok", "tokenizer", "backend"}


def _encoding_calls(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        kw = {k.arg for k in node.keywords}
        if isinstance(f, ast.Attribute) and f.attr in ("encode", "encode_batch") and \
                ("add_special_tokens" in kw or f.attr == "encode_batch"):
            yield node.lineno, ast.unparse(f)
        elif isinstance(f, ast.Attribute) and f.attr == "apply_chat_template" and any(
                k.arg == "tokenize" and not (isinstance(k.value, ast.Constant)
                                             and k.value.value is False)
                for k in node.keywords):
            yield node.lineno, ast.unparse(f)
        elif isinstance(f, ast.Attribute) and f.attr == "apply_chat_template" and \
                "tokenize" not in kw:
            yield node.lineno, ast.unparse(f) + " (tokenize defaults to True)"
        elif isinstance(f, (ast.Name, ast.Attribute)) and \
                (f.id if isinstance(f, ast.Name) else f.attr) in _TOKENIZER_NAMES:
            yield node.lineno, ast.unparse(f) + "(...)"
        elif isinstance(f, ast.Attribute) and f.attr == "encode" and \
                isinstance(f.value, (ast.Name, ast.Attribute)) and \
                (f.value.id if isinstance(f.value, ast.Name) else f.value.attr) \
                in _TOKENIZER_NAMES:
            yield node.lineno, ast.unparse(f)


def test_no_place_encodes_text_but_the_one_rule():
    """The walk: no module of brf and no main calls a tokenizer on text itself."""
    allowed = {os.path.join("brf", "align", "vocab.py")}
    found = []
    for top in ("brf", "experiments"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, ROOT)
                if rel in allowed:
                    continue
                found += [f"{rel}:{line}: {call}" for line, call in _encoding_calls(path)]
    assert not found, found


def test_the_walk_sees_the_calls_it_forbids(tmp_path):
    """The walk is not blind: each kind of direct call is found."""
    src = tmp_path / "m.py"
    src.write_text("tok.encode(t, add_special_tokens=False)\n"
                   "backend.encode_batch(ts)\n"
                   "tok.apply_chat_template(m, tokenize=True)\n"
                   "tok.apply_chat_template(m)\n"
                   "m.tokenizer(text)\n"
                   "tok(text)\n"
                   "tok.apply_chat_template(m, tokenize=False)\n"
                   "'x'.encode('utf-8')\n")
    assert [line for line, _ in _encoding_calls(src)] == [1, 2, 3, 4, 5, 6]


def test_encode_template_without_special_strings_is_the_tokenizers_own(tokenizers):
    """Valid input does not change: no special string in a field -> the tokenizer's ids."""
    for name, tok in tokenizers.items():
        backend = getattr(tok, "backend_tokenizer", tok)
        for special in (False, True):
            got = encode_template(tok, lambda f: "A {x} B".replace("{x}", f["x"]),
                                  {"x": "plain text 12"}, add_special_tokens=special)
            assert got == list(backend.encode("A plain text 12 B",
                                              add_special_tokens=special).ids), name
    assert np.all(np.asarray(encode_text(tok, "")) == np.asarray([], int))
