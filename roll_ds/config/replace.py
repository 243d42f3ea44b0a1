"""Replace, not merge: the composed config's ``replace:`` section.

Hydra merges the dicts of a config into those it inherits, so a config deriving from
``rlvr_lora_zero3`` cannot drop the inherited ``math`` / ``reverse`` domains or reward roles by
redefining them. What it puts under ``replace:`` mirrors the config and is set on the composed
config instead of merged: sections that are typed config classes (``actor_train``,
``data_args``, ...) are walked into, and the first dict, list or value met replaces the
inherited one whole::

    replace:
      rewards:                       # the reward roles are exactly these
        gsm8k: {tag_included: [gsm8k], reward_fns: [{name: math_rule, weight: 1.0}]}
      actor_train:
        data_args:
          domain_interleave_probs: {gsm8k: 1.0}

Applied after Hydra composes (run.py, ``compose_config``); the replaced values are checked
against the schema as they are set. A command-line override of a replaced key would be
applied by Hydra first and then lost, so it is an error that says to override
``++replace.<key>=...`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import is_dataclass

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from roll_ds.config.validate import ConfigError

SECTION = "replace"


def replacement_points(cfg: DictConfig, section: DictConfig, prefix: str = "") -> Iterator[str]:
    """Dotted keys of the composed config that ``section`` replaces whole."""
    for key in section:
        path = f"{prefix}{key}"
        node = cfg._get_node(key) if key in cfg else None
        value = section._get_node(key)
        typed = isinstance(node, DictConfig) and is_dataclass(OmegaConf.get_type(node))
        if typed and isinstance(value, DictConfig) and not node._is_none():
            yield from replacement_points(node, value, f"{path}.")
        else:
            yield path


def replaced_point(key: str, points: Sequence[str]) -> str | None:
    """The replacement point (``replacement_points``) that ``key`` is or lies under, or None."""
    return next((p for p in points if key == p or key.startswith(f"{p}.")), None)


def apply_replacements(cfg: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """Set every value of ``cfg.replace`` on ``cfg`` (in place; returned). ``overrides``: the
    command-line overrides Hydra applied, checked against the replaced keys."""
    section = cfg.get(SECTION) if SECTION in cfg else None
    if not section:
        return cfg
    points = list(replacement_points(cfg, section))
    problems = []
    for override in overrides:
        hit = replaced_point(override.split("=", 1)[0].lstrip("+~"), points)
        if hit is not None:
            problems.append(
                f"{override}: {hit} is set by the config's `{SECTION}:` section, which replaces it "
                f"after overrides apply; override ++{SECTION}.{override.lstrip('+~')} instead"
            )
    for path in points:
        try:
            _replace(cfg, path, OmegaConf.select(section, path))
        except OmegaConfBaseException as exc:
            where = getattr(exc, "full_key", None) or path
            problems.append(f"{SECTION}.{where}: {str(exc).splitlines()[0]}")
    if problems:
        raise ConfigError(problems)
    return cfg


def _replace(cfg: DictConfig, path: str, value: object) -> None:
    """Set ``path`` to ``value`` through OmegaConf's merge, so that the value is checked and
    typed by the schema (a reward role becomes a ``RewardConfig``), after emptying a dict."""
    parent_path, _, key = path.rpartition(".")
    parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
    if key not in parent:
        raise ConfigKeyError(f"Key '{key}' is not in {OmegaConf.get_type(parent).__name__}")
    target = parent._get_node(key)
    with open_dict(parent):
        if (
            isinstance(target, DictConfig)
            and not target._is_none()
            and not is_dataclass(OmegaConf.get_type(target))
        ):
            target._set_value({})
        parent.merge_with({key: value})
