"""A registry of a project's extension points by name (model families by ``model_type``, transports by handle
``transport``): registration order kept, a second entry under one name refused, an unknown name an error of the
registry's own class naming the known ones."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``what``: the entries' kind in messages ("model family known for model_type"); ``key``: an entry's name;
    ``unknown``: the error class raised for a name nobody registered, which lists the known names in registration
    order, or sorted (``sort``)."""

    def __init__(self, what: str, key: Callable[[T], str], unknown: type[Exception], sort: bool = False):
        self.what, self.key, self.unknown, self.sort = what, key, unknown, sort
        self._entries: dict[str, T] = {}

    def register(self, entry: T) -> T:
        """Add ``entry`` after those registered before it (ValueError if its name is taken)."""
        name = self.key(entry)
        if name in self._entries:
            raise ValueError(f"{name!r} is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        del self._entries[name]

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise self.unknown(f"no {self.what} {name!r}; known: {', '.join(sorted(self._entries) if self.sort else self._entries)}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entries(self) -> tuple[T, ...]:
        return tuple(self._entries.values())
