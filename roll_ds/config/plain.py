"""OmegaConf nodes as plain Python values, for code that must not hold config nodes (DeepSpeed
and vLLM want JSON-like dicts). Imports omegaconf only when given one of its nodes."""

from __future__ import annotations

import copy
from typing import Any


def to_plain(node: Any) -> Any:
    """An OmegaConf container as resolved dicts / lists; anything else as it is."""
    if type(node).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(node, resolve=True)
    return node


def plain_dict(node: Any) -> dict[str, Any]:
    """A mapping (OmegaConf node or dict; None gives ``{}``) as a fresh plain dict the caller
    may change without touching ``node``."""
    if node is None:
        return {}
    plain = to_plain(node)
    return plain if plain is not node else copy.deepcopy(dict(node))
