"""Command-line overrides of sections that are null in the composed config.

Optional sections (``reference``, ``critic``, ``rewards.<name>.judge``, a DeepSpeed preset not
pulled in, a null ``strategy_config``) are null until a config sets them. Hydra applies every
override through ``OmegaConf.update``, which fails on them:

    rewards.math.judge.template=...   (with +, ++ or neither)
        AssertionError: Unexpected type for root: NoneType      (a traceback, no key named)
    rewards.math.judge={template: ...}
        AttributeError: 'NoneType' object has no attribute 'get'  (merging into the null node)

``guard_overrides`` has Hydra apply overrides through ``apply_overrides``: an override that
sets a null section whole (a mapping) sets it, by merging it into the section's parent, where
OmegaConf handles a null node; one that reaches inside a null section is refused naming the
section and the whole-section override to type instead. Installed by ``run.py`` and
``compose.compose_config`` before Hydra composes. Hydra calls its
``ConfigLoaderImpl._apply_overrides_to_config`` once with every config override; the guard
hands it the overrides one at a time (hydra-core is pinned to 1.3.8 in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

_HYDRA_APPLY: Callable[[list[Override], DictConfig], None] = (
    ConfigLoaderImpl._apply_overrides_to_config
)


def null_section(cfg: DictConfig, key: str, *, whole: bool) -> str | None:
    """The dotted path of the first null section on ``key``'s path through ``cfg``, or None.
    ``whole``: the override sets ``key`` itself to a mapping, so a null ``key`` counts."""
    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts, start=1):
        if not isinstance(node, DictConfig):
            return None  # a list: Hydra's own errors
        child = node._get_node(part, validate_access=False, throw_on_missing_key=False)
        if child is None or child._is_interpolation():
            return None  # not there (Hydra adds it with +, or says so); interpolated: hints.py
        if child._is_none() and (depth < len(parts) or whole):
            return ".".join(parts[:depth])
        node = child
    return None


def null_section_problem(override: Override, section: str) -> str:
    """What to type instead of ``override``, which reaches inside the null ``section``."""
    key = override.key_or_group
    value = (override.input_line or "").partition("=")[2]
    whole = value
    for part in reversed(key[len(section) + 1 :].split(".")):
        whole = f"{{{part}: {whole}}}"
    return (
        f"{override.input_line}: {section} is null in this config, so there is no {key} to set; "
        f"set {section} whole instead: '{section}={whole}' (the keys left out take their "
        f"defaults), or set {section} in your YAML"
    )


def apply_overrides(overrides: Sequence[Override], cfg: DictConfig) -> None:
    """Hydra's override step (``_apply_overrides_to_config``), one override at a time, with
    null sections set whole or refused (see the module doc)."""
    for override in overrides:
        value = None if override.is_delete() else override.value()
        whole = isinstance(value, dict)
        section = None
        if override.package is None and not override.is_delete():
            section = null_section(cfg, override.key_or_group, whole=whole)
        if section is None:
            _HYDRA_APPLY([override], cfg)
        elif section != override.key_or_group:
            raise ConfigCompositionException(null_section_problem(override, section))
        else:
            _set_null_section(cfg, override, value)


def _set_null_section(cfg: DictConfig, override: Override, value: dict) -> None:
    parent_key, _, key = override.key_or_group.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    try:
        parent.merge_with({key: value})
    except OmegaConfBaseException as exc:  # a key the section's schema lacks, a wrong type
        raise ConfigCompositionException(f"Error merging override {override.input_line}") from exc


def guard_overrides() -> None:
    """Have Hydra apply command-line overrides through ``apply_overrides`` (idempotent)."""
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply_overrides)  # type: ignore[method-assign]
