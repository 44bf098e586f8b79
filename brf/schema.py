"""Config schemas: every key of a config checked for type and range, in one place.

Each experiment's config family (``configs/<name>.py``) declares one schema, a
table from each key's dotted path to a :class:`Key` (its kind, its range, the
special values that mean "off" or "all", and for a string that names something
the check against its registry), next to the code that reads the config:

    validate     brf.eval.plan.SCHEMA
    generate     brf.ensemble.run.SCHEMA
    dump_logits  brf.eval.dump.SCHEMA
    analyze_csv  brf.eval.csv_analysis.SCHEMA
    demo         brf.eval.tables.SCHEMA

:func:`check` walks a config against its schema before anything is loaded or
computed, and raises the family's :class:`brf.errors.UserError` (one line, exit
status 2 in a main) naming the first key that is wrong as the user typed it
(``config.stats.n_boot must be an integer <= 100000; got 100000000``). A key the
schema does not know is refused too, so a config file cannot grow a setting that
nothing checks (``tests/test_config_schema.py`` walks every key of every config
file against a table of bad values).

A schema checks one key at a time; what relates two keys (a phase map's offsets
against the number of members, the study's methods against its NLL baselines) is
checked by the family's reader right after. The study's schema never touches JAX
(it runs before ``jax.distributed.initialize``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from brf.errors import UserError

# Seeds: JAX's PRNGKey keeps 32 bits without x64 (2**32 gives the key of 0), so a
# larger seed would silently repeat a smaller one's draws.
SEED_MAX = 2**32 - 1
# Resampling counts (bootstrap replicates, permutations): 100,000 permutations give
# p-values in steps of 1e-5, finer than any report prints; more only cost time and
# memory (10^8 ran on at 4.4 GB, issue 54).
RESAMPLES_MAX = 100_000
# Counts that size a computation (tokens, positions, characters) and have no
# tighter bound of their own.
COUNT_MAX = 10**9
# Device counts of a mesh axis.
DEVICES_MAX = 65_536


class ConfigError(UserError):
    """A config key of the wrong type or out of range (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Key:
    """What one config key must hold.

    Attributes:
      kind: 'int', 'float', 'bool', 'str', 'strs' (a sequence of strings),
        'floats' (a sequence of numbers, or of such sequences), 'mapping' (a dict,
        its entries checked by ``check``) or 'any' (``check`` alone decides).
      low, high: the range (inclusive, unless ``low_open`` / ``high_open``); None:
        unbounded on that side. Floats must be finite in any case.
      special: values allowed outside the range ("0: off", "-1: every device").
      note: what the special values mean, shown in the message.
      choices: the only values a string may take.
      empty: a string (or sequence) may be empty.
      check: ``check(value)`` for what a type and a range cannot say (a name
        against its registry, a spec string that must parse); raises a
        :class:`UserError`, which :func:`check` words with the key's name.
    """
    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple = ()
    note: str = ""
    choices: tuple = ()
    empty: bool = True
    check: Callable[[Any], None] | None = None

    def validate(self, value: Any, where: str) -> None:
        """Raises ConfigError naming ``where`` when ``value`` does not fit."""
        if self.kind in ("int", "float") and _is_number(value, self.kind == "int") \
                and value in self.special:
            return
        getattr(self, f"_check_{self.kind}")(value, where)
        if self.check is not None:
            try:
                self.check(value)
            except UserError as e:
                msg = str(e)
                if where not in msg:  # the key as the user typed it, the value once
                    msg = (f"{where}: {msg}" if repr(value) in msg
                           else f"{where}={_short(value)}: {msg}")
                raise ConfigError(msg) from None

    # -- one method per kind -------------------------------------------------

    def _range_words(self) -> str:
        lo, hi = self.low, self.high
        if lo is not None and hi is not None:
            if self.kind == "int":
                return f"in [{lo}, {hi}]"
            return (f"in {'(' if self.low_open else '['}{_num(lo)}, {_num(hi)}"
                    f"{')' if self.high_open else ']'}")
        if lo is not None:
            return f"{'>' if self.low_open else '>='} {_num(lo)}"
        if hi is not None:
            return f"{'<' if self.high_open else '<='} {_num(hi)}"
        return ""

    def _fail(self, where: str, what: str, value: Any) -> None:
        note = f" ({self.note})" if self.note else ""
        raise ConfigError(f"{where} must {what}{note}; got {_short(value)}")

    def _check_range(self, value, where: str, what: str) -> None:
        lo, hi = self.low, self.high
        below = lo is not None and (value <= lo if self.low_open else value < lo)
        above = hi is not None and (value >= hi if self.high_open else value > hi)
        if not (below or above):
            return
        if lo is not None and hi is not None and self.kind == "float":
            self._fail(where, f"lie in {self._range_words()[3:]}", value)
        if below:
            self._fail(where, f"be {what} {'>' if self.low_open else '>='} {_num(lo)}", value)
        self._fail(where, f"be {what} {'<' if self.high_open else '<='} {_num(hi)}", value)

    def _check_int(self, value, where: str) -> None:
        if not _is_number(value, True):
            rng = self._range_words()
            self._fail(where, f"be an integer{' ' + rng if rng else ''}", value)
        self._check_range(value, where, "an integer")

    def _check_float(self, value, where: str) -> None:
        if not _is_number(value, False):
            rng = self._range_words()
            self._fail(where, f"be a number{' ' + rng if rng else ''}", value)
        if not math.isfinite(float(value)):
            self._fail(where, "be a finite number", value)
        self._check_range(float(value), where, "a number")

    def _check_bool(self, value, where: str) -> None:
        if not isinstance(value, (bool, np.bool_)):
            self._fail(where, "be True or False", value)

    def _check_str(self, value, where: str) -> None:
        if not isinstance(value, str):
            self._fail(where, "be a string", value)
        if self.choices and value not in self.choices:
            self._fail(where, f"be one of {', '.join(map(repr, self.choices))}", value)
        if not self.empty and not value.strip():
            raise ConfigError(f"{where} is empty" + (f" ({self.note})" if self.note else ""))

    def _check_strs(self, value, where: str) -> None:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            self._fail(where, "be a list of strings", value)
        for i, item in enumerate(value, 1):
            if not isinstance(item, str):
                raise ConfigError(f"{where}: item {i} must be a string; got {_short(item)}")
        if not self.empty and not value:
            raise ConfigError(f"{where} is empty" + (f" ({self.note})" if self.note else ""))

    def _check_floats(self, value, where: str) -> None:
        def walk(x, path):
            if isinstance(x, (list, tuple)):
                for i, e in enumerate(x, 1):
                    walk(e, path + [i])
                return
            at = f"{where}" + "".join(f"[{i}]" for i in path)
            if not _is_number(x, False):
                raise ConfigError(f"{at} must be a number; got {_short(x)}")
            if not math.isfinite(float(x)):
                raise ConfigError(f"{at} must be a finite number; got {_short(x)}")
            lo, hi = self.low, self.high
            if (lo is not None and x < lo) or (hi is not None and x > hi):
                raise ConfigError(f"{at} must be {self._range_words()}; got {_short(x)}")

        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            self._fail(where, "be a list of numbers", value)
        if not self.empty and not value:
            raise ConfigError(f"{where} is empty")
        walk(value, [])

    def _check_mapping(self, value, where: str) -> None:
        if not isinstance(value, Mapping) and not hasattr(value, "items"):
            self._fail(where, "be a mapping (a dict)", value)

    def _check_any(self, value, where: str) -> None:
        pass


# -- constructors: the schema tables read as sentences ---------------------------

def integer(low: int | None = 0, high: int | None = COUNT_MAX, *, special: tuple = (),
            note: str = "") -> Key:
    """An integer in [low, high]; ``special`` values are allowed besides."""
    return Key("int", low, high, special=special, note=note)


def seed() -> Key:
    """A random seed: an integer in [0, 2**32 - 1]."""
    return integer(0, SEED_MAX, note="seeds are 32-bit: a larger one would repeat a smaller "
                                      "one's draws")


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, special: tuple = (), note: str = "") -> Key:
    """A finite number (an int is read as a float) in the range."""
    return Key("float", low, high, low_open, high_open, special=special, note=note)


def flag() -> Key:
    """True or False."""
    return Key("bool")


def text(*, choices: tuple = (), empty: bool = True, check: Callable | None = None,
         note: str = "") -> Key:
    """A string; ``choices`` lists the only values it may take."""
    return Key("str", choices=tuple(choices), empty=empty, check=check, note=note)


def texts(*, empty: bool = True, check: Callable | None = None, note: str = "") -> Key:
    """A list (or tuple) of strings."""
    return Key("strs", empty=empty, check=check, note=note)


def numbers(low: float | None = None, high: float | None = None, *, empty: bool = False,
            check: Callable | None = None) -> Key:
    """A list of finite numbers (or a list of such lists)."""
    return Key("floats", low, high, empty=empty, check=check)


def mapping(check: Callable | None = None) -> Key:
    """A dict whose entries ``check`` reads."""
    return Key("mapping", check=check)


def custom(check: Callable) -> Key:
    """Anything ``check`` accepts."""
    return Key("any", check=check)


# -- the walk --------------------------------------------------------------------

def leaves(cfg: Any, schema: Mapping[str, Key] | None = None, prefix: str = ""):
    """(dotted key, value) of every setting of ``cfg``: nested sections are walked,
    except a key the schema declares itself (a mapping-valued setting)."""
    for key, value in cfg.items():
        path = prefix + str(key)
        if (schema is None or path not in schema) and _is_section(value):
            yield from leaves(value, schema, path + ".")
        else:
            yield path, value


def check(cfg: Any, schema: Mapping[str, Key], *, where: str = "config",
          error: type[UserError] = ConfigError) -> None:
    """Checks every key of ``cfg`` against ``schema``; a key absent from ``cfg`` (or
    a section set to None) keeps its reader's default and is not checked.

    Args:
      cfg: the config (an ml_collections ConfigDict or a dict).
      schema: dotted key -> :class:`Key`.
      where: the config's name in messages.
      error: the family's own UserError class, raised with the message (its
        callers catch it by that name).

    Raises:
      error: the first key (in the config's order) of the wrong type or out of
        range, or one the schema does not know.
    """
    for path, value in leaves(cfg, schema):
        key = schema.get(path)
        if key is None and value is None and any(k.startswith(path + ".") for k in schema):
            continue  # a section set to None (mesh=None): its reader's defaults
        try:
            if key is None:
                sections = sorted({k.split(".")[0] for k in schema})
                raise ConfigError(f"{where}.{path} is not a setting of this experiment (its "
                                  f"settings: {', '.join(sections)})")
            key.validate(value, f"{where}.{path}")
        except ConfigError as e:
            if error is ConfigError:
                raise
            raise error(str(e)) from None


def _is_section(value: Any) -> bool:
    return hasattr(value, "items") and not isinstance(value, str)


def _is_number(value: Any, integral: bool) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    if integral:
        return isinstance(value, (int, np.integer))
    return isinstance(value, (int, float, np.integer, np.floating))


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _short(value: Any, limit: int = 80) -> str:
    """The value as typed, on one line, cut at ``limit`` characters."""
    if hasattr(value, "to_dict"):  # a ConfigDict's repr is YAML over several lines
        value = value.to_dict()
    text = repr(value).replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


__all__ = ["COUNT_MAX", "ConfigError", "DEVICES_MAX", "Key", "RESAMPLES_MAX", "SEED_MAX",
           "check", "custom", "flag", "integer", "leaves", "mapping", "number", "numbers",
           "seed", "text", "texts"]
