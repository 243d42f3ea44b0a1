"""A tiny name -> object registry, one instance per kind of swappable part.

    KL_ESTIMATORS: Registry[KlFn] = Registry("kl estimator")

    @KL_ESTIMATORS.register("k1")
    def kl_k1(logprobs_BT, ref_logprobs_BT): ...

    KL_ESTIMATORS.get("k4")
    # ValueError: unknown kl estimator 'k4'; valid: k1, k2, k3

Entries can also be registered lazily as ``"module:attr"`` strings (``register_lazy``) so that
names can be listed and configs validated without importing heavy backends; ``get`` imports
them on first use. ``resolve`` also takes an import path of the user's own (``mymod:MyClass``)
where a config names a part that is not registered (environments, reward functions): one
resolver, ``import_target``, for every such path. No imports beyond the standard library.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def import_target(target: str) -> object:
    """The object an import path ``"package.module:attr"`` names (the module imported)."""
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def import_path_problem(target: str) -> str | None:
    """Why ``"module:attr"`` names nothing importable, or None; the module is imported (so a
    missing attribute is found too). The launch directory is importable under ``run.py``."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        return f"{target!r} is not an import path module:Class"
    try:
        import_target(target)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        return (
            f"cannot import module {missing!r} of {target!r} (put it in the directory you "
            "launch from, or on PYTHONPATH)"
        )
    except AttributeError:
        return f"module {module_name!r} has no {attr!r} ({target!r})"
    except Exception as exc:  # the user's module failed while importing
        return f"importing {module_name!r} of {target!r} failed: {type(exc).__name__}: {exc}"
    return None


def find_path_problem(target: str) -> str | None:
    """Like ``import_path_problem`` without importing: only the module is looked for (parts
    that run in their own processes are imported there)."""
    module_name, _, attr = target.partition(":")
    try:
        found = bool(module_name) and importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        found = False
    if found and attr:
        return None
    return (
        f"cannot find module {module_name!r} of {target!r} (put it in the directory you launch "
        "from, or on PYTHONPATH)"
    )


def is_import_path(name: str) -> bool:
    return ":" in name


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
            entry = import_target(entry.target)
            self._entries[name] = entry
        return entry

    def resolve(self, name: str) -> T:
        """A registered name's entry, or the object an import path ``module:attr`` of the
        user's own names (not registered: nothing to list)."""
        if name not in self._entries and is_import_path(name):
            return import_target(name)
        return self.get(name)

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
