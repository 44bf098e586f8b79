"""A tiny name -> object registry, one per extension point.

brf has one registry each for fusion methods, phase maps, samplers, model
architectures and vocabulary aligners. Adding an extension means writing a
function and decorating it with ``@REGISTRY.register("name")``; configs and
sweeps then refer to it by name.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from brf.errors import UserError

T = TypeVar("T")


class UnknownNameError(UserError, KeyError):
    """A name that no registry entry answers to (lists the known names)."""

    def __str__(self) -> str:  # KeyError quotes its message; we do not want that.
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to entries of one kind (e.g. fusion methods).

    Attributes:
        kind: what the entries are, used in error messages ("fusion method").
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: registers its argument under ``name`` and returns it."""

        def deco(entry: T) -> T:
            self.add(name, entry)
            return entry

        return deco

    def add(self, name: str, entry: T) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        """Returns the entry for ``name``; raises UnknownNameError naming the options."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            known = ", ".join(sorted(self._entries))
            raise UnknownNameError(
                    f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
