"""Logit CSVs: one row per token position, the top-k logits and what recovers p.

Format ``brf-logit-csv`` version 1 (what :class:`CsvWriter` writes and
:func:`read_csv` reads; docs/csv.md repeats it for users):

* **Comment lines** at the top start with ``#``. Line 1 is the magic
  ``# brf-logit-csv 1``; line 2 is ``# `` followed by one JSON object, the
  run's metadata (``format``, ``version``, ``mode`` = ``score`` | ``generate``,
  ``model``, ``k``, ``vocab_size``, ``prefix``, ``system``, ``text_sha256``,
  ``prompts``, ``sampler``, ``seed``, ``context_ids``, ``context_text`` ...).
  Both lines are optional for CSVs written by other tools; metadata then
  defaults to ``{}``. No ``#`` occurs anywhere else in the file (token texts
  escape it), so ``pandas.read_csv(path, comment="#")`` and ``csv.reader``
  over the non-``#`` lines both read it.
* **The context**: ``context_ids`` are the token ids the model read before the
  first row (score mode: one list, BOS, the chat-templated system turn and the
  prefix; generate mode: one list per prompt, the whole wrapped prompt) and
  ``context_text`` the same tokens as text fields (escaped like
  ``token_text``: ``\\!<|im_start|>`` is a control token), so a CSV made
  elsewhere can be checked against the context it must match.
  ``context_tokens`` (score mode) is their number.
* **Versions**: the number changes when the rows or the header change.
  Metadata keys are added within a version and readers take what is there:
  ``context_ids`` and ``context_text`` came after the first version-1 files,
  which lack them; those read the same and resume.
* **Header row**, then one row per position::

      seq,position,token_id,token_text,token_logit,lse,entropy,gap,
      logit_1..logit_k,id_1..id_k,text_1..text_k,crc32

  - ``seq``: the sequence (0 when scoring one text; the prompt's index when
    generating). ``position``: index of the token this row is about in the
    scored text (or in the generated continuation), counted from 0 after any
    BOS / system prompt / prefix.
  - The row's distribution is the model's next-token distribution *at* this
    position: given the prefix and the tokens before ``position``.
    ``token_id`` / ``token_text`` is the token that is actually there (the
    gold token when scoring, the chosen token when generating) and
    ``token_logit`` its logit.
  - ``lse`` = logsumexp of the full logit vector (the log-normaliser):
    ``log p(t) = logit(t) - lse``. ``entropy`` (nats) of the full
    distribution; ``gap`` = ``logit_1 - logit_2``.
  - ``logit_j``, ``id_j``, ``text_j``: the j-th largest raw (pre-softmax,
    float32) logit, its token id and text, j = 1..k.
  - ``crc32``: 8 lowercase hex digits, zlib CRC-32 of the row's ASCII text up
    to (not including) the comma before it. A row cut short by an interrupted
    dump fails it, so it can never read as valid.
* **Numbers**: integers in decimal; floats with 9 significant digits (``%.9g``),
  which gives back the float32 value exactly; ``-inf`` allowed in ``logit_j``.
* **Token texts** (``token_text``, ``text_j``) are the token's exact bytes,
  escaped so that a field holds no comma, quote, ``#``, whitespace other than
  space, or non-ASCII: printable ASCII stands for itself except ``\\`` (written
  ``\\\\``) and ``,`` ``"`` ``#`` (written ``\\x2c`` ``\\x22`` ``\\x23``); every
  other byte is ``\\xNN``. A control token (BOS, EOS, chat markers) has no text
  bytes: it is written ``\\!`` followed by its escaped token string, e.g.
  ``\\!<|im_end|>``. :func:`unescape` inverts it.

**Minimal columns** of a CSV another tool writes: ``position``, ``lse``,
``logit_1..logit_k`` and ``id_1..id_k`` (k >= 2). Optional: ``seq`` (default
0), ``token_id`` + ``token_logit`` (needed for NLL and per-token phase maps),
``gap`` (default ``logit_1 - logit_2``), ``entropy``, the text columns (needed
to align two different tokenizers), ``crc32`` (checked when present).
Fields may be quoted as ``csv`` writes them; a field may not contain a
newline.

**Writing** streams rows in blocks (one ``write`` + ``flush`` per block).
**Resuming**: :class:`CsvWriter` re-opens a file written with the same
metadata, keeps the longest prefix of rows whose checksums hold, truncates
the rest (a partial last line) and reports how many rows each sequence
already has; the producer skips them. Different metadata, or a bad row
followed by good ones, is refused.
"""

from __future__ import annotations

import csv
import json
import os
import zlib
from typing import Any, NamedTuple, Sequence

import numpy as np

from brf.errors import UserError

FORMAT = "brf-logit-csv"
VERSION = 1
MAGIC = f"# {FORMAT} {VERSION}"
FIXED_COLUMNS = ("seq", "position", "token_id", "token_text", "token_logit", "lse",
                 "entropy", "gap")
REQUIRED = ("position", "lse")
# Metadata keys that need not agree for a dump to be resumed.
_VOLATILE_META = ("created", "seconds")
# Keys added after the first version-1 files: a file without them resumes (what
# they record follows from the keys it has: model, system, prefix, prompts).
_ADDED_META = ("context_ids", "context_text")


class CsvError(UserError):
    """A logit CSV that cannot be read (the message names file, line, column)."""


def columns(k: int) -> list[str]:
    """The header of a version-1 file with top-k columns."""
    return (list(FIXED_COLUMNS) + [f"logit_{j}" for j in range(1, k + 1)]
            + [f"id_{j}" for j in range(1, k + 1)] + [f"text_{j}" for j in range(1, k + 1)]
            + ["crc32"])


# ---------------------------------------------------------------------------
# Token text escaping.
# ---------------------------------------------------------------------------

_ESC = []
for _b in range(256):
    if 0x20 <= _b < 0x7F and chr(_b) not in '\\,"#':
        _ESC.append(chr(_b))
    elif _b == 0x5C:
        _ESC.append("\\\\")
    else:
        _ESC.append(f"\\x{_b:02x}")


def escape_bytes(data: bytes) -> str:
    """A token's bytes as a field: printable ASCII kept, ``\\\\``, else ``\\xNN``."""
    return "".join(_ESC[b] for b in data)


def escape_token(data: bytes, control: bool = False, name: str = "") -> str:
    """A token's text field; control tokens are ``\\!`` + their escaped name."""
    if control:
        return "\\!" + escape_bytes(name.encode("utf-8"))
    return escape_bytes(data)


def unescape(field: str) -> tuple[bytes, bool]:
    """Inverts :func:`escape_token`: (text bytes, is_control). Control tokens give b"".

    Characters other than escapes stand for their UTF-8 bytes (lenient for
    other tools' files).

    Raises:
        ValueError: a dangling backslash or a bad ``\\xNN``.
    """
    if field.startswith("\\!"):
        return b"", True
    if "\\" not in field:
        return field.encode("utf-8"), False
    out, i, n = bytearray(), 0, len(field)
    while i < n:
        ch = field[i]
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
        elif field.startswith("\\\\", i):
            out.append(0x5C)
            i += 2
        elif field.startswith("\\x", i) and i + 4 <= n:
            out.append(int(field[i + 2:i + 4], 16))
            i += 4
        else:
            raise ValueError(f"bad escape at character {i} of {field!r}")
    return bytes(out), False


def vocab_texts(tokenizer, vocab_size: int) -> np.ndarray:
    """Escaped text of every id < vocab_size (object array; rows past the tokenizer: ``\\!``)."""
    from brf.align.vocab import token_table
    table = token_table(tokenizer)
    names = tokenizer.convert_ids_to_tokens(list(range(min(table.size, vocab_size))))
    out = np.empty(vocab_size, object)
    out[:] = "\\!"
    for i in range(min(table.size, vocab_size)):
        out[i] = escape_token(table.token_bytes[i], bool(table.control_V[i]), names[i] or "")
    return out


# ---------------------------------------------------------------------------
# Writing.
# ---------------------------------------------------------------------------


class RowBlock(NamedTuple):
    """A block of rows, as arrays (C rows, k top entries).

    Attributes:
      seq, position, token_id: int [C].
      token_logit, lse, entropy, gap: float32 [C].
      top_logits: float32 [C, k], descending.
      top_ids: int [C, k].
    """
    seq: np.ndarray
    position: np.ndarray
    token_id: np.ndarray
    token_logit: np.ndarray
    lse: np.ndarray
    entropy: np.ndarray
    gap: np.ndarray
    top_logits: np.ndarray
    top_ids: np.ndarray


def _num(x: np.ndarray) -> list:
    """float32 values as Python floats (exact), for ``%.9g``."""
    return np.asarray(x, np.float32).astype(np.float64).tolist()


def format_rows(block: RowBlock, texts_V: np.ndarray) -> str:
    """The CSV text of a block (each line with its checksum and a newline).

    Per block: one ``tolist`` per array, one text lookup for all ids, then a
    precompiled ``%`` format per row (measured in BENCHMARKS.md with the dump).
    """
    c, k = np.shape(block.top_ids)
    fmt = ("%d,%d,%d,%s,%.9g,%.9g,%.9g,%.9g," + ",".join(["%.9g"] * k) + ","
           + ",".join(["%d"] * k) + "," + ",".join(["%s"] * k))
    ids = np.asarray(block.top_ids, np.int64)
    tok = np.asarray(block.token_id, np.int64)
    texts = texts_V[ids].tolist()
    tok_texts = texts_V[tok].tolist()
    head = zip(np.asarray(block.seq, np.int64).tolist(), np.asarray(block.position).tolist(),
               tok.tolist(), tok_texts, _num(block.token_logit), _num(block.lse),
               _num(block.entropy), _num(block.gap))
    logits, idl = _num(block.top_logits), ids.tolist()
    crc = zlib.crc32
    lines = []
    for h, lg, ii, tt in zip(head, logits, idl, texts):
        line = fmt % (h + tuple(lg) + tuple(ii) + tuple(tt))
        lines.append(f"{line},{crc(line.encode('ascii')):08x}\n")
    return "".join(lines)


def _meta_key(meta: dict, old: dict | None = None) -> dict:
    """The keys that must agree; with ``old`` (the existing file's metadata), the
    added keys it lacks are left out too."""
    skip = set(_VOLATILE_META) | ({k for k in _ADDED_META if k not in old} if old else set())
    return {k: v for k, v in meta.items() if k not in skip}


class CsvWriter:
    """Streams rows to a version-1 logit CSV; resumes an interrupted one.

    Args:
      path: the CSV file.
      meta: the run's metadata (JSON-serialisable; ``format``, ``version`` and
        ``k`` are added). A resumed file must carry the same metadata.
      k: top entries per row.
      texts_V: escaped token texts (:func:`vocab_texts`).
      resume: keep the complete rows of an existing file with the same
        metadata (else the file is started anew).

    Attributes:
      done: seq -> rows already in the file (the producer skips them).
      n_rows: rows in the file.
    """

    def __init__(self, path: str, meta: dict, k: int, texts_V: np.ndarray, *,
                 resume: bool = True):
        self.path, self.k, self.texts_V = path, k, texts_V
        self.meta = {"format": FORMAT, "version": VERSION, **meta, "k": k}
        self.done: dict[int, int] = {}
        self.n_rows = 0
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        if resume and os.path.exists(path) and os.path.getsize(path) > 0:
            keep = self._scan_existing()
            self._f = open(path, "r+b")
            self._f.truncate(keep)
            self._f.seek(keep)
        else:
            self._f = open(path, "wb")
            self._f.write((MAGIC + "\n# " + json.dumps(self.meta) + "\n"
                           + ",".join(columns(k)) + "\n").encode("ascii"))
            self._f.flush()

    def _scan_existing(self) -> int:
        """Byte length of the valid part of an existing file (rows counted in done)."""
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        if len(lines) < 4 or lines[0].decode("ascii", "replace") != MAGIC:
            raise CsvError(f"{self.path}: exists and is not a {FORMAT} {VERSION} file with a "
                           f"header; delete it or set overwrite")
        try:
            old = json.loads(lines[1][2:].decode("utf-8"))
        except ValueError:
            raise CsvError(f"{self.path}: line 2: the metadata is not JSON") from None
        new = _meta_key(json.loads(json.dumps(self.meta)), old)
        if _meta_key(old) != new:
            diff = sorted(k for k in set(old) | set(new)
                          if k not in _VOLATILE_META and old.get(k) != new.get(k))
            raise CsvError(f"{self.path}: exists with different settings ({', '.join(diff)}); "
                           f"delete it, write elsewhere, or set overwrite")
        if lines[2].decode("ascii", "replace") != ",".join(columns(self.k)):
            raise CsvError(f"{self.path}: line 3: the header is not this version's header")
        offset = sum(len(x) + 1 for x in lines[:3])
        bad_at = None
        for i, raw in enumerate(lines[3:], start=4):
            complete = i - 1 < len(lines) - 1  # followed by a newline
            ok = complete and _crc_ok(raw)
            if ok and bad_at is not None:
                raise CsvError(f"{self.path}: line {bad_at} is damaged but later rows are "
                               f"intact (edited?); refusing to resume")
            if not ok:  # only the tail may be bad: a partial line, nothing after it
                if bad_at is None and (raw or complete):
                    bad_at = i
                continue
            seq = int(raw.split(b",", 1)[0])
            self.done[seq] = self.done.get(seq, 0) + 1
            self.n_rows += 1
            offset += len(raw) + 1
        return offset

    def write(self, block: RowBlock) -> None:
        """Appends a block and flushes it."""
        if len(block.seq) == 0:
            return
        self._f.write(format_rows(block, self.texts_V).encode("ascii"))
        self._f.flush()
        self.n_rows += len(block.seq)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _crc_ok(raw: bytes) -> bool:
    cut = raw.rfind(b",")
    if cut < 0:
        return False
    try:
        return zlib.crc32(raw[:cut]) == int(raw[cut + 1:], 16) and len(raw) - cut == 9
    except ValueError:
        return False


# ---------------------------------------------------------------------------
# Reading.
# ---------------------------------------------------------------------------


class LogitRun(NamedTuple):
    """One logit CSV read back (R rows, k top entries).

    Attributes:
      path: the file.
      meta: its metadata ({} when it has none).
      seq, position: int64 [R].
      token_id: int64 [R] or None; token_logit: float32 [R] or None.
      lse: float32 [R]; gap: float32 [R] (the column, else logit_1 - logit_2);
      entropy: float32 [R] or None.
      top_logits: float32 [R, k]; top_ids: int64 [R, k].
      token_text: list of R fields or None; top_texts: R lists of k fields or None.
      lines: int64 [R], the file line of each row (for messages).
    """
    path: str
    meta: dict
    seq: np.ndarray
    position: np.ndarray
    token_id: np.ndarray | None
    token_logit: np.ndarray | None
    lse: np.ndarray
    gap: np.ndarray
    entropy: np.ndarray | None
    top_logits: np.ndarray
    top_ids: np.ndarray
    token_text: list | None
    top_texts: list | None
    lines: np.ndarray

    @property
    def k(self) -> int:
        return int(self.top_logits.shape[1])

    @property
    def n_rows(self) -> int:
        return int(self.lse.shape[0])

    def top_logp(self) -> np.ndarray:
        """[R, k] float32 log-probabilities of the top-k tokens (logit - lse)."""
        return self.top_logits - self.lse[:, None]

    def where(self, row: int, column: str) -> str:
        return f"{self.path}: line {int(self.lines[row])} (row {row + 1}), column {column!r}"


def _column(path, name, values, lines, kind):
    """One column's strings as numbers; a bad value raises naming file, line, column.

    kind: "int"; "float" (finite); "logit" (finite or -inf).
    """
    dtype = np.int64 if kind == "int" else np.float64
    try:
        arr = np.asarray(values, dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        arr = None
    if arr is None:
        for i, v in enumerate(values):
            try:
                int(v) if kind == "int" else float(v)
            except (ValueError, TypeError, OverflowError):
                what = "an integer" if kind == "int" else "a number"
                raise CsvError(f"{path}: line {lines[i]} (row {i + 1}), column {name!r}: "
                               f"{v!r} is not {what}") from None
        arr = np.asarray([int(v) if kind == "int" else float(v) for v in values], dtype)
    if kind != "int":
        bad = np.isnan(arr) | (arr == np.inf) | ((arr == -np.inf) if kind == "float" else False)
        if bad.any():
            i = int(np.argmax(bad))
            raise CsvError(f"{path}: line {lines[i]} (row {i + 1}), column {name!r}: "
                           f"{values[i]!r} is not a finite number")
    return arr


def read_csv(path: str, vocab_size: int | None = None) -> LogitRun:
    """Reads a logit CSV (ours, or another tool's with the documented columns).

    Args:
      path: the file.
      vocab_size: the model's vocabulary size when the file's metadata lacks it
        (or to override it): token ids must lie below it.

    Raises:
      CsvError: unreadable file, no header, a missing column, a row with the
        wrong number of fields, a bad checksum, a non-numeric value, an empty
        file, or a row that breaks what its columns promise
        (:func:`check_invariants`); the message names the file, line (1-based),
        row and column.
    """
    raw_lines = _text_lines(path)
    meta, i = _read_meta(path, raw_lines)
    if i >= len(raw_lines):
        raise CsvError(f"{path}: no header row (an empty file, or comments only)")
    header_line = i + 1
    header = [h.strip() for h in next(csv.reader([raw_lines[i].rstrip("\r")]))]
    col = {h: j for j, h in enumerate(header)}
    k = _top_k(path, col, header, header_line)
    body = [s.rstrip("\r") for s in raw_lines[i + 1:]]
    lines = np.arange(i + 2, i + 2 + len(body))
    keep = [j for j, s in enumerate(body) if s.strip()]
    body, lines = [body[j] for j in keep], lines[keep]
    if not body:
        raise CsvError(f"{path}: no rows after the header (line {header_line})")
    if "crc32" in col:
        for j, s in enumerate(body):
            if not _crc_ok(s.encode("utf-8")):
                last = j == len(body) - 1
                raise CsvError(
                    f"{path}: line {lines[j]} (row {j + 1}), column 'crc32': checksum does not "
                    f"match the row" + (" (a partial last row: an interrupted dump? resume "
                                        "it or delete the line)" if last else " (edited?)"))
    rows = list(csv.reader(body))
    for j, r in enumerate(rows):
        if len(r) != len(header):
            raise CsvError(f"{path}: line {lines[j]} (row {j + 1}): {len(r)} fields, the "
                           f"header has {len(header)}")
    run = _run_from_columns(path, meta, list(zip(*rows)), col, k, lines)
    check_invariants(run, vocab_size or run.meta.get("vocab_size"))
    return run


# Float32 logits written with 9 digits read back exactly; another tool's file may
# round (6 digits): a relative slack of 1e-5 on comparisons of logits, 1e-3 on the
# top-k mass (a sum of k rounded exponentials).
_REL = 1e-5
_MASS_SLACK = 1e-3


def check_invariants(run: LogitRun, vocab_size: int | None = None) -> None:
    """Refuses rows that cannot come from a next-token distribution, naming the first:

    * a (seq, position) given twice, or positions going back within a sequence
      (rows are in text order: byte alignment reads them so);
    * the top ids of a row not distinct tokens, or an id (top or ``token_id``)
      negative or not below ``vocab_size`` (when known);
    * ``logit_1..logit_k`` not descending (``-inf`` only at the end);
    * ``lse`` below the log-sum-exp of the row's top logits (the top k would hold
      more than all the probability), or ``token_logit`` above ``lse``;
    * a negative ``entropy`` or ``gap``;
    * a derived column that the row's logits contradict (:func:`check_derived`).

    Raises:
      CsvError: file, line, row and column of the first broken row.
    """
    _check_order(run)
    _check_ids(run, vocab_size)
    _check_logits(run)
    check_derived(run, vocab_size)


def _refuse_first(run: LogitRun, bad: np.ndarray, column, message) -> None:
    """Raises CsvError at the first row where ``bad`` holds, naming its file, line and
    column (``column``: a name, or a function of the row) and ``message(row)``."""
    if bad.any():
        r = int(np.argmax(bad))
        col = column(r) if callable(column) else column
        raise CsvError(f"{run.where(r, col)}: {message(r)}")


def _check_order(run: LogitRun) -> None:
    """Each (seq, position) once, positions ascending within a sequence."""
    seq, pos = run.seq, run.position
    key = np.stack([seq, pos], 1)
    order = np.lexsort((pos, seq))
    same = np.all(key[order][1:] == key[order][:-1], axis=1)
    if same.any():
        a, b = sorted(order[np.argmax(same):][:2])
        raise CsvError(f"{run.where(int(b), 'position')}: (seq {int(seq[b])}, position "
                       f"{int(pos[b])}) is also line {int(run.lines[a])}: a position has one "
                       f"row")
    back = (seq[1:] == seq[:-1]) & (pos[1:] < pos[:-1])
    _refuse_first(run, np.concatenate([[False], back]), "position", lambda r: (
        f"position {int(pos[r])} after {int(pos[r - 1])} in sequence {int(seq[r])}: rows "
        f"must be in text order"))


def _check_ids(run: LogitRun, vocab_size: int | None) -> None:
    """A row's top ids distinct; every id (top or ``token_id``) in [0, vocab_size)."""
    ids = run.top_ids
    srt = np.sort(ids, axis=1)
    rep = srt[:, 1:] == srt[:, :-1]
    if rep.any():
        r = int(np.argmax(rep.any(axis=1)))
        dup = int(srt[r, 1:][rep[r]][0])
        js = [j + 1 for j in np.nonzero(ids[r] == dup)[0][:2]]
        raise CsvError(f"{run.where(r, f'id_{js[1]}')}: id {dup} repeats id_{js[0]} (a row's "
                       f"top ids are distinct tokens)")
    for name, arr in (("id_{}", ids), ("token_id", run.token_id)):
        if arr is None:
            continue
        arr2 = arr.reshape(len(arr), -1)
        bad = (arr2 < 0) | ((arr2 >= vocab_size) if vocab_size else False)
        if bad.any():
            r, j = np.argwhere(bad)[0]
            col = name.format(j + 1) if "{" in name else name
            limit = f"[0, {vocab_size})" if vocab_size else ">= 0"
            raise CsvError(f"{run.where(int(r), col)}: token id {int(arr2[r, j])} is not in "
                           f"{limit}" + ("" if not vocab_size else
                                         f" (the vocabulary has {vocab_size} tokens)"))


def _check_logits(run: LogitRun) -> None:
    """The top logits descending, ``lse`` at least their log-sum-exp and at least
    ``token_logit``, ``entropy`` and ``gap`` not negative (each within the rounding
    slack of another tool's file)."""
    top = run.top_logits.astype(np.float64)
    slack = _REL * np.maximum(1.0, np.abs(top[:, :-1]))
    finite_next = np.isfinite(top[:, 1:])
    up = (top[:, 1:] > top[:, :-1] + slack) & finite_next | (
        ~np.isfinite(top[:, :-1]) & finite_next)
    if up.any():
        r, j = np.argwhere(up)[0]
        raise CsvError(f"{run.where(int(r), f'logit_{j + 2}')}: {top[r, j + 1]:.9g} is above "
                       f"logit_{j + 1} = {top[r, j]:.9g} (the top logits are in descending "
                       f"order)")
    lse = run.lse.astype(np.float64)
    m = top[:, 0]
    with np.errstate(over="ignore", invalid="ignore"):
        top_lse = m + np.log(np.exp(top - m[:, None]).sum(1))
    over = top_lse > lse + np.log1p(_MASS_SLACK) + _REL * np.maximum(1.0, np.abs(lse))
    _refuse_first(run, over, "lse", lambda r: (
        f"{lse[r]:.9g} is below the log-sum-exp of the row's top logits ({top_lse[r]:.9g}): "
        f"the top k would hold more than all the probability (lse is the log-normaliser of "
        f"all the logits)"))
    if run.token_logit is not None:
        tl = run.token_logit.astype(np.float64)
        _refuse_first(run, tl > lse + _REL * np.maximum(1.0, np.abs(lse)), "token_logit",
                      lambda r: f"{tl[r]:.9g} is above lse {lse[r]:.9g} (a token's "
                                f"probability would exceed 1)")
    for name, arr in (("entropy", run.entropy), ("gap", run.gap)):
        if arr is not None:
            _refuse_first(run, arr < -_REL, name, lambda r: f"{float(arr[r]):.9g} is negative")


def _slack(x: np.ndarray) -> np.ndarray:
    """The tolerance of a comparison with ``x`` (a rounded number, ``_REL``); 0 where
    ``x`` is not finite."""
    return _REL * np.maximum(1.0, np.abs(np.where(np.isfinite(x), x, 0.0)))


# The entropy column is computed over the whole vocabulary in float32: its rounding
# grows with the vocabulary, hence a wider slack than a logit's.
_ENTROPY_SLACK = 1e-3


def check_derived(run: LogitRun, vocab_size: int | None = None) -> None:
    """Refuses derived columns that the row's own logits contradict (issue 71: a
    ``gap`` of 7.0 in a row whose top logits differ by 0.5, with its checksum
    recomputed, changed the coherence statistics), naming the first:

    * ``gap`` other than ``logit_1 - logit_2``;
    * ``token_logit`` other than ``logit_j`` where ``token_id`` is ``id_j``, or above
      ``logit_k`` where the token is not among the top k (it would be one of them);
    * ``entropy`` below ``lse - logit_1`` (the entropy is at least the min-entropy
      ``-log p_1``) or above ``log(vocab_size)`` (when known).

    The slack is that of another tool's rounded numbers (``_REL``; the entropy's
    ``_ENTROPY_SLACK``).

    Raises:
      CsvError: file, line, row and column of the first contradicted value.
    """
    top = run.top_logits.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        gap = top[:, 0] - top[:, 1]
    scale = np.maximum(1.0, np.maximum(np.abs(top[:, 0]), np.abs(np.nan_to_num(
        top[:, 1], neginf=0.0))))
    ok = np.isfinite(gap)
    off = ok & (np.abs(run.gap.astype(np.float64) - np.where(ok, gap, 0.0)) > 4 * _REL * scale)
    _refuse_first(run, off, "gap", lambda r: (
        f"{float(run.gap[r]):.9g} but the row's logit_1 - logit_2 = {gap[r]:.9g} (gap is "
        f"that difference)"))
    if run.token_id is not None and run.token_logit is not None:
        tl = run.token_logit.astype(np.float64)
        hit = run.top_ids == run.token_id[:, None]
        j = np.argmax(hit, axis=1)
        listed = hit.any(axis=1)
        at = top[np.arange(len(top)), j]
        with np.errstate(invalid="ignore"):
            wrong = listed & ~((tl == at) | (np.abs(tl - at) <= _slack(at)))
        _refuse_first(run, wrong, "token_logit", lambda r: (
            f"{tl[r]:.9g} but token_id {int(run.token_id[r])} is id_{int(j[r]) + 1}, whose "
            f"logit is {at[r]:.9g}"))
        last = top[:, -1]
        with np.errstate(invalid="ignore"):
            above = ~listed & np.isfinite(last) & (tl > last + _slack(last))
        _refuse_first(run, above, "token_logit", lambda r: (
            f"{tl[r]:.9g} is above logit_{run.k} = {last[r]:.9g} but token_id "
            f"{int(run.token_id[r])} is not among the row's top {run.k} ids"))
    if run.entropy is not None:
        h = run.entropy.astype(np.float64)
        lse = run.lse.astype(np.float64)
        floor = lse - top[:, 0]  # -log p_1, the min-entropy
        slack = _ENTROPY_SLACK * np.maximum(1.0, np.abs(floor)) + _REL * np.abs(lse)
        _refuse_first(run, h < floor - slack, "entropy", lambda r: (
            f"{h[r]:.9g} is below -log p_1 = lse - logit_1 = {floor[r]:.9g} (no distribution "
            f"whose largest probability is p_1 has less entropy)"))
        if vocab_size:
            ceiling = float(np.log(vocab_size))
            _refuse_first(run, h > ceiling + _ENTROPY_SLACK * max(1.0, ceiling), "entropy",
                          lambda r: f"{h[r]:.9g} is above log(vocab size) = {ceiling:.9g}, "
                                    f"the entropy of the uniform distribution over "
                                    f"{vocab_size} tokens")


def _text_lines(path: str) -> list[str]:
    """The file's lines (UTF-8), without a final empty one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CsvError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CsvError(f"{path}: not a text (UTF-8) file (byte {e.start})") from None
    raw_lines = text.split("\n")
    if raw_lines and raw_lines[-1] == "":
        raw_lines.pop()
    return raw_lines


def _read_meta(path: str, raw_lines: list[str]) -> tuple[dict, int]:
    """(metadata, index of the header line): the comment lines first, checked."""
    meta: dict[str, Any] = {}
    i = 0
    while i < len(raw_lines) and (raw_lines[i].startswith("#") or not raw_lines[i].strip()):
        s = raw_lines[i]
        if i == 1 and s.startswith("# {") and raw_lines[0].startswith(f"# {FORMAT}"):
            try:
                meta = json.loads(s[2:])
            except ValueError:
                raise CsvError(f"{path}: line 2: the metadata is not JSON") from None
        i += 1
    if raw_lines and raw_lines[0].startswith(f"# {FORMAT} "):
        ver = raw_lines[0].split()[-1]
        if ver != str(VERSION):
            raise CsvError(f"{path}: line 1: format version {ver}; this brf reads {VERSION}")
    return meta, i


def _top_k(path: str, col: dict, header: list[str], header_line: int) -> int:
    """k of the logit_1..logit_k / id_1..id_k columns, the required columns checked."""
    for name in REQUIRED + ("logit_1", "logit_2", "id_1", "id_2"):
        if name not in col:
            raise CsvError(f"{path}: line {header_line}: missing column {name!r} (the header "
                           f"has {', '.join(header[:8])}{', ...' if len(header) > 8 else ''})")
    k = 0
    while f"logit_{k + 1}" in col:
        k += 1
    for j in range(1, k + 1):
        if f"id_{j}" not in col:
            raise CsvError(f"{path}: line {header_line}: missing column 'id_{j}' "
                           f"(there are logit_1..logit_{k})")
    return k


def _run_from_columns(path: str, meta: dict, cols: list, col: dict, k: int,
                      lines: np.ndarray) -> LogitRun:
    """The LogitRun of a file's parsed columns (optional ones filled or None)."""
    def get(name, kind):
        return _column(path, name, cols[col[name]], lines, kind)

    n = len(lines)
    seq = get("seq", "int") if "seq" in col else np.zeros(n, np.int64)
    position = get("position", "int")
    lse = get("lse", "float").astype(np.float32)
    top_logits = np.stack([get(f"logit_{j}", "logit") for j in range(1, k + 1)],
                          1).astype(np.float32)
    top_ids = np.stack([get(f"id_{j}", "int") for j in range(1, k + 1)], 1)
    token_id = get("token_id", "int") if "token_id" in col else None
    token_logit = (get("token_logit", "logit").astype(np.float32) if "token_logit" in col
                   else None)
    gap = (get("gap", "float").astype(np.float32) if "gap" in col
           else (top_logits[:, 0] - top_logits[:, 1]).astype(np.float32))
    entropy = get("entropy", "float").astype(np.float32) if "entropy" in col else None
    token_text = list(cols[col["token_text"]]) if "token_text" in col else None
    top_texts = (list(zip(*(cols[col[f"text_{j}"]] for j in range(1, k + 1))))
                 if all(f"text_{j}" in col for j in range(1, k + 1)) else None)
    return LogitRun(path, meta, seq, position, token_id, token_logit, lse, gap, entropy,
                    top_logits, top_ids, token_text, top_texts, lines)


# ---------------------------------------------------------------------------
# Two (or more) runs on the same text: alignment and the event table.
# ---------------------------------------------------------------------------


def content_digest(run: LogitRun) -> str:
    """SHA-256 of what a run's rows say (positions, top ids and logits, lse, the
    token's id and logit), whatever the file's name, comments or number format: two
    files with the same digest are one run."""
    import hashlib
    h = hashlib.sha256()
    for arr in (run.seq, run.position, run.top_ids, run.top_logits, run.lse,
                run.token_id, run.token_logit):
        if arr is not None:
            a = np.ascontiguousarray(arr)
            h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


def _key_rows(run: LogitRun) -> dict:
    return {(int(s), int(p)): r for r, (s, p) in enumerate(zip(run.seq, run.position))}


# Two tokenizers are compared on co-aligned byte offsets instead (align_bytes).
_BYTES_HINT = " Different tokenizers: use --config.align=bytes"


def align_positions(runs: Sequence[LogitRun]) -> np.ndarray:
    """[P, n] row indices of the same (seq, position) in every run (same tokenizer).

    The runs must hold the same positions in the same order and, where both
    give ``token_id``, the same tokens there: that is what makes two runs on
    one text comparable position by position.

    Raises:
      CsvError: the first row where the runs disagree (file, line, column).
    """
    a = runs[0]
    out = [np.arange(a.n_rows)]
    for b in runs[1:]:
        n = min(a.n_rows, b.n_rows)
        for name in ("seq", "position", "token_id"):
            x, y = getattr(a, name), getattr(b, name)
            if x is None or y is None:
                continue
            diff = np.nonzero(x[:n] != y[:n])[0]
            if diff.size:
                r = int(diff[0])
                raise CsvError(f"{b.where(r, name)}: {name} {int(y[r])} where {a.path} line "
                               f"{int(a.lines[r])} has {int(x[r])}: the runs are not on the "
                               f"same positions (same text, same tokenizer?{_BYTES_HINT})")
        if a.n_rows != b.n_rows:
            longer, shorter = (a, b) if a.n_rows > b.n_rows else (b, a)
            raise CsvError(f"{longer.where(n, 'position')}: position {int(longer.position[n])} "
                           f"has no row in {shorter.path} ({shorter.n_rows} rows against "
                           f"{longer.n_rows}): the runs are not on the same positions "
                           f"(same text, same tokenizer?{_BYTES_HINT})")
        out.append(np.arange(b.n_rows))
    return np.stack(out, 1)


def _row_bytes(run: LogitRun) -> list[bytes]:
    if run.token_text is None:
        raise CsvError(f"{run.path}: aligning by bytes needs the column 'token_text'")
    out = []
    for r, f in enumerate(run.token_text):
        try:
            out.append(unescape(f)[0])
        except ValueError as e:
            raise CsvError(f"{run.where(r, 'token_text')}: {e}") from None
    return out


def align_bytes(runs: Sequence[LogitRun]) -> np.ndarray:
    """[P, n] rows of co-aligned positions of runs with different tokenizers.

    The rule of the validation experiment (:mod:`brf.eval.events`): a row's
    byte offset is the number of text bytes of the tokens before it in its
    sequence; positions are co-aligned where every run has a row at the same
    (seq, offset) and every run's token there is the same non-empty byte
    string. Offsets count from each sequence's first row, so every run must
    start each sequence at the same text (its first row at position 0, or the
    same text before it).
    """
    maps = []
    for run in runs:
        tb = _row_bytes(run)
        m, off, cur = {}, 0, None
        for r, (s, b) in enumerate(zip(run.seq, tb)):
            if s != cur:
                cur, off = s, 0
            if b:
                m[(int(s), off)] = (r, b)
            off += len(b)
        maps.append(m)
    common = sorted(set.intersection(*(set(m) for m in maps)))
    rows = [[m[key][0] for m in maps] for key in common
            if all(m[key][1] == maps[0][key][1] for m in maps)]
    if not rows:
        raise CsvError(f"{runs[0].path} and {runs[1].path}: no co-aligned positions (no "
                       f"offset where both predict the same next text)")
    return np.asarray(rows, np.int64)


def event_table(runs: Sequence[LogitRun], rows_PxN: np.ndarray, *, by: str = "id",
                vocab_sizes: Sequence[int | None] | None = None, progress: bool = False):
    """The validation experiment's event table (:class:`brf.eval.fitting.EventTable`).

    Per aligned position, the rules of :mod:`brf.eval.events`: events are every
    run's top-k tokens (keyed by id, or by text bytes with ``by="bytes"``;
    control tokens and empty texts are dropped as there) and OTHER; the gold
    adds no event (where no run lists it, the gold event is OTHER and the
    table's gold offset scores the token). Each run's mass: its top-k tokens
    exactly (``logit - lse``); a listed token outside its top-k an equal share
    of its tail, ``(1 - top-k mass) / (V - k)`` with V its vocabulary size; the
    rest on OTHER. With ``by="bytes"`` every listed string is taken to be
    expressible by every run (a CSV does not carry the vocabulary), the one
    difference from :mod:`brf.eval.events`; with ``by="id"`` the rule is the
    same.

    Args:
      runs: the runs (members), each with token_id and token_logit.
      rows_PxN: aligned rows (:func:`align_positions` / :func:`align_bytes`).
      by: "id" (same tokenizer) or "bytes".
      vocab_sizes: per run V (default: the metadata's ``vocab_size``).
      progress: a bar over the positions on stderr.

    Returns:
      EventTable (gold_bytes from the token texts, 1 where unknown; segment =
      seq).

    Raises:
      CsvError: a run lacks token_id/token_logit or its vocabulary size.
    """
    from brf.eval.events import fill_position
    from brf.event_table import EventTable
    n = len(runs)
    sizes = _vocab_sizes(runs, vocab_sizes)
    p = rows_PxN.shape[0]
    k = max(r.k for r in runs)
    logp = np.full((p, n, 1 + n * k), -np.inf, np.float32)
    gap = np.zeros((p, n), np.float32)
    gold_col = np.zeros(p, np.int64)
    offset = np.zeros(p, np.float64)
    texts = [None] * n
    top_b = [None] * n
    if by == "bytes":
        texts = [_row_bytes(r) for r in runs]
        for j, r in enumerate(runs):
            if not r.top_texts:
                raise CsvError(f"{r.path}: aligning by bytes needs the columns text_1..text_k")
            top_b[j] = [[unescape(f)[0] for f in row] for row in r.top_texts]
    top_lp = [r.top_logp() for r in runs]
    gold_lp = [(r.token_logit - r.lse).astype(np.float32) for r in runs]
    gold_bytes = np.ones(p, np.int64)
    positions = range(p)
    if progress:
        from tqdm.auto import tqdm
        positions = tqdm(positions, desc="event table", unit="pos", dynamic_ncols=True,
                         leave=False)
    for q in positions:
        rows = rows_PxN[q]
        if by == "bytes":
            g = texts[0][rows[0]]
            gold_bytes[q] = len(g)
        else:
            g = int(runs[0].token_id[rows[0]])
            tt = runs[0].token_text
            if tt is not None:
                gold_bytes[q] = max(1, len(unescape(tt[rows[0]])[0]))
        lists = [_listed_mass(top_b[i][rows[i]] if by == "bytes" else run.top_ids[rows[i]].tolist(),
                              top_lp[i][rows[i]], skip_empty=by == "bytes")
                 for i, run in enumerate(runs)]
        gold_col[q], offset[q] = fill_position(logp[q], g, lists,
                                               [gold_lp[i][rows[i]] for i in range(n)], sizes)
        gap[q] = [run.gap[rows[i]] for i, run in enumerate(runs)]
    used = int(np.isfinite(logp).any(axis=(0, 1)).nonzero()[0].max()) + 1
    return EventTable(logp[:, :, :used], gold_col, gap, gold_bytes,
                      np.asarray(runs[0].seq[rows_PxN[:, 0]], np.int64), offset)


def _vocab_sizes(runs: Sequence[LogitRun], given: Sequence[int | None] | None) -> list[int]:
    """Each run's vocabulary size (given, else its metadata's), checked."""
    sizes = []
    for j, run in enumerate(runs):
        if run.token_id is None or run.token_logit is None:
            raise CsvError(f"{run.path}: the event table needs the columns 'token_id' and "
                           f"'token_logit' (the gold token and its logit)")
        v = given[j] if given and given[j] else run.meta.get("vocab_size")
        if not v:
            raise CsvError(f"{run.path}: no vocab_size in its metadata line; give it "
                           f"(--config.vocab_sizes) to share tail mass")
        sizes.append(int(v))
    return sizes


def _listed_mass(keys, top_lp, *, skip_empty: bool) -> dict:
    """One run's listed events at a position: its top-k keys (summed when they repeat)
    -> log-prob."""
    mass = {}
    for key, lp in zip(keys, top_lp):
        if skip_empty and not key:
            continue
        mass[key] = np.logaddexp(mass[key], lp) if key in mass else lp
    return mass


__all__ = ["CsvError", "CsvWriter", "FIXED_COLUMNS", "FORMAT", "LogitRun", "MAGIC",
           "REQUIRED", "RowBlock", "VERSION", "align_bytes", "align_positions",
           "check_derived", "check_invariants", "columns", "content_digest",
           "escape_bytes", "escape_token", "event_table", "format_rows", "read_csv",
           "unescape", "vocab_texts"]
