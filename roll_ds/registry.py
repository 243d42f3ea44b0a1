"""A tiny name -> object registry, one instance per kind of swappable part.

    KL_ESTIMATORS: Registry[KlFn] = Registry("kl estimator")

    @KL_ESTIMATORS.register("k1")
    def kl_k1(logprobs_BT, ref_logprobs_BT): ...

    KL_ESTIMATORS.get("k4")
    # ValueError: unknown kl estimator 'k4'; valid: k1, k2, k3

Entries can also be registered lazily as ``"module:attr"`` strings (``register_lazy``) so that
names can be listed and configs validated without importing heavy backends; ``get`` imports
them on first use. No imports beyond the standard library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class _Lazy:
    __slots__ = ("target",)

    def __init__(self, target: str) -> None:
        self.target = target


class Registry(Generic[T]):
    """Maps names to objects of one kind; unknown names fail listing the valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T | _Lazy] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under `name` and return it unchanged."""

        def decorate(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorate

    def add(self, name: str, obj: T) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self._entries[name] = obj

    def register_lazy(self, name: str, target: str) -> None:
        """Register ``"package.module:attr"``, imported by the first ``get(name)``."""
        if ":" not in target:
            raise ValueError(
                f"lazy {self.kind} target must look like 'module:attr', got {target!r}"
            )
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self._entries[name] = _Lazy(target)

    def check(self, name: str) -> None:
        """Raise the unknown-name error (listing the valid names) without importing anything."""
        if name not in self._entries:
            raise ValueError(self.unknown_message(name))

    def get(self, name: str) -> T:
        self.check(name)
        entry = self._entries[name]
        if isinstance(entry, _Lazy):
            module_name, _, attr = entry.target.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[name] = entry
        return entry

    def unknown_message(self, name: object) -> str:
        return f"unknown {self.kind} '{name}'; valid: {', '.join(self.names())}"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
