"""The one way qdeploy's registries (tasks, candidate kinds, optimize steps) take a new entry."""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def registrar(table: dict, what: str, key: Callable[[T], str]) -> Callable[[T], T]:
    """A decorator that adds an object to ``table`` under ``key(obj)``; a second entry of the same key is a bug."""

    def register(obj: T) -> T:
        name = key(obj)
        if name in table:
            raise ValueError(f"{what} {name!r} is registered twice")
        table[name] = obj
        return obj

    return register
