"""roll_ds's hint under Hydra's message when Hydra rejects a command-line override.

Hydra reports a misspelled key as ``Key 'learnin_rate' not in 'TrainingArgs'`` and an override
inside an interpolated ``strategy_config`` (``${deepspeed_zero3}``) as ``Key 'zero_optimization'
is not in struct``, and suggests ``+key=value``, which does not help in either case. ``hint_for``
reads the error text and returns what to type instead, or None; ``run.py`` prints it below
Hydra's own message (``hint_for_exception`` takes the exception Hydra reported). Given the
config's name (and directory), it also finds an override of a key that only the config's
``replace:`` section sets (a new ``custom_envs.<tag>``): Hydra calls it "not in struct" and
suggests ``+``, which then fails on its type; the hint says ``++replace.<key>=...``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from roll_ds.config import schema
from roll_ds.config.similar import close_keys

_OVERRIDE = re.compile(r"Could not override '(?P<key>[^']+)'")
_APPEND = re.compile(r"Could not append to config\. An item is already at '(?P<key>[^']+)'")
_MERGE = re.compile(r"Error merging override (?P<key>[^=\s]+)=")
# The override's value, from Hydra's "use +key=value" or "'++key=value'" suggestion.
_VALUES = (
    re.compile(r"To append to your config use \+(?P<key>[^=\s]+)=(?P<value>\S*)"),
    re.compile(r"'\+\+(?P<key>[^=']+)=(?P<value>[^']*)'"),
)
_NOT_IN_SCHEMA = re.compile(r"Key '(?P<name>[^']+)' not in '(?P<schema>\w+)'")
_FULL_KEY = re.compile(r"full_key: (?P<key>\S+)")
STRATEGY_CONFIG = ".strategy_args.strategy_config."
# Top-level keys of a DeepSpeed JSON: an override under strategy_config that starts with one of
# these (or under a training role) is aimed at a DeepSpeed preset.
DEEPSPEED_KEYS = (
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
)
TRAINING_ROLES = ("actor_train", "critic")


def hint_for_exception(
    exc: BaseException | None,
    *,
    config_name: str | None = None,
    config_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> str | None:
    """The hint for an exception Hydra reported, or None (for errors other than Hydra's or
    OmegaConf's, and for the ones without a hint). With ``config_name`` (the config composed
    with ``overrides``) an override of a key set only under its ``replace:`` gets that hint."""
    if not isinstance(exc, HydraException | OmegaConfBaseException):
        return None
    text = str(exc)
    if exc.__cause__ is not None:
        text += "\n" + str(exc.__cause__)
    found = _OVERRIDE.search(text) or _APPEND.search(text) or _MERGE.search(text)
    if found and config_name:
        hint = replaced_key_hint(found["key"].lstrip("+~"), config_name, config_dir, overrides)
        if hint:
            return hint
    return hint_for(text)


def hint_for_run(exc: BaseException | None, argv: Sequence[str]) -> str | None:
    """``hint_for_exception`` for ``run.py``'s command line ``argv`` (``sys.argv[1:]``)."""
    name, directory, overrides = _run_args(argv)
    return hint_for_exception(exc, config_name=name, config_dir=directory, overrides=overrides)


def _run_args(argv: Sequence[str]) -> tuple[str | None, str | None, list[str]]:
    """Hydra's ``--config-name`` / ``-cn``, ``--config-dir`` / ``-cd`` and the overrides."""
    flags = {"--config-name": 0, "-cn": 0, "--config-dir": 1, "-cd": 1}
    found: list[str | None] = [None, None]
    overrides: list[str] = []
    args = list(argv)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            found[flags[flag]] = value if eq else (args[i + 1] if i + 1 < len(args) else None)
        elif not arg.startswith("-") and "=" in arg and (i == 0 or args[i - 1] not in flags):
            overrides.append(arg)
    return found[0], found[1], overrides


def replaced_key_hint(
    key: str, config_name: str, config_dir: str | Path | None, overrides: Sequence[str]
) -> str | None:
    """For an override of ``key`` that the config's ``replace:`` section sets (on a value it
    replaces whole): the ``++replace.<key>=...`` override to use. The config is composed again
    without the rejected override (None when that fails too)."""
    from roll_ds.config.compose import compose_config
    from roll_ds.config.replace import SECTION, replaced_point, replacement_points

    given = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") == key]
    others = [o for o in overrides if o not in given]
    try:
        cfg = compose_config(config_name, others, config_dir, replace=False)
    except Exception:  # the other overrides fail too: Hydra's message is the one to read
        return None
    section = cfg.get(SECTION) if SECTION in cfg else None
    if not section:
        return None
    point = replaced_point(key, list(replacement_points(cfg, section)))
    if point is None:
        return None
    value = given[0].split("=", 1)[1] if given and "=" in given[0] else "..."
    return (
        f"{key}: {point} is set by the config's `{SECTION}:` section (which replaces it after "
        f"overrides apply, so it is not in the composed config yet); override "
        f"++{SECTION}.{key}={value} instead"
    )


def hint_for(text: str) -> str | None:
    """The hint for Hydra's error message ``text``, or None."""
    found = _OVERRIDE.search(text) or _APPEND.search(text)
    key = found["key"].lstrip("+") if found else None
    if key and STRATEGY_CONFIG in key and _aims_at_deepspeed(key):
        return strategy_config_hint(key, _value(text, key))
    misspelled = _NOT_IN_SCHEMA.search(text)
    if misspelled:
        full_key = _FULL_KEY.search(text)
        where = full_key["key"] if full_key else key or misspelled["name"]
        return misspelled_key_hint(where, misspelled["name"], misspelled["schema"])
    return None


def _aims_at_deepspeed(key: str) -> bool:
    role, _, inner = key.partition(STRATEGY_CONFIG)
    return role.split(".")[-1] in TRAINING_ROLES or inner.split(".")[0] in DEEPSPEED_KEYS


def _value(text: str, key: str) -> str:
    for pattern in _VALUES:
        found = pattern.search(text)
        if found and found["key"] == key:
            return found["value"]
    return "..."


def strategy_config_hint(key: str, value: str = "...") -> str:
    """For an override of ``<role>.strategy_args.strategy_config.<inner>``: the preset the
    strategy_config interpolates is where the value lives."""
    role_config, _, inner = key.partition(STRATEGY_CONFIG)
    field = role_config + STRATEGY_CONFIG.rstrip(".")
    lines = [
        f"{field} is an interpolation of a DeepSpeed preset (such as ${{deepspeed_zero3}}); "
        "keys inside it cannot be overridden on its path.",
        f"  - to switch presets (e.g. the ZeRO stage): {field}='${{deepspeed_zero2}}'",
        f"  - to change one value, override it in the preset the role uses: "
        f"deepspeed_zero3.{inner}={value} (every role using that preset sees it)",
        f"  (++{key}={value} would replace the whole strategy_config by that one key)",
    ]
    return "\n".join(lines)


def misspelled_key_hint(full_key: str, name: str, schema_name: str) -> str:
    """For a key the schema section ``schema_name`` does not have: the closest field names."""
    section = getattr(schema, schema_name, None)
    if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
        return f"{full_key}: not a roll_ds config key"
    valid = [f.name for f in dataclasses.fields(section)]
    parent = full_key.rpartition(".")[0]
    close = close_keys(name, section)
    hint = f"{full_key}: {schema_name} has no key {name!r}"
    if close:
        hint += "; did you mean " + " or ".join(_join(parent, c) for c in close) + "?"
    return hint + f"\n  valid keys of {parent or 'the root'}: {', '.join(valid)}"


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name
