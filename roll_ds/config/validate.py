"""Check a composed pipeline config before any actor starts.

Every problem is collected and reported at once; each line names the field and the fix. Type and
key errors are already caught by Hydra against the schema (and ``to_schema`` here); the allowed
values of each scalar field are tables in ``ranges.py``. ``validate`` collects what neither can
check from the components that own it, in this order:

    roll_ds/config/checks/      fields, each role (strategy, devices, LoRA targets), roles against
                                each other, lengths, algorithm, async, paths
    roll_ds/config/strategies.py    each backend's own checks, by name
                                (``StrategySpec.role_checks``, ``rollout_checks``:
                                strategies/vllm/config_checks.py, deepspeed/config_checks.py)
    roll_ds/config/role_placement.py    each role's devices and world size
    roll_ds/platform.py         the device
    roll_ds/config/checks/device.py    the device-dependent checks under what ``device: auto``
                                resolves to (``platform.planned_device``)
    roll_ds/config/checks/components.py    the components' own checks, by name: rewards/
                                config_checks.py, weight_sync/config_checks.py and select.py,
                                pipeline/colocation/checks.py and eval_metrics.py, agentic/
                                config_checks.py, data/sources.py, strategies/deepspeed/
                                config_checks.py (ZeRO++, NVMe offload)

``roll_ds/config/`` imports none of the components it collects from (they sit above it and import
the schema): each is named by ``"module:function"`` and imported when ``validate`` first runs.

Settings that are valid but have no effect (``no_effect.config_warnings``), that measured slower
than leaving them out (``checks.micro_batches.packing_warnings``), or a generation cap that cuts
every answer below ``response_length`` (``checks.lengths.generation_cap_warnings``) are logged as
warnings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import fields, is_dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from roll_ds.config.agentic import has_environments, row_groups
from roll_ds.config.checks.components import component_problems
from roll_ds.config.checks.device import device_problems_before_start
from roll_ds.config.checks.fields import pipeline_field_problems
from roll_ds.config.checks.lengths import generation_cap_warnings, length_problems
from roll_ds.config.checks.micro_batches import packing_warnings
from roll_ds.config.checks.pipeline import (
    algorithm_problems,
    async_problems,
    model_path_problems,
    path_problems,
    pipeline_problems,
)
from roll_ds.config.checks.roles import role_problems
from roll_ds.config.no_effect import config_warnings
from roll_ds.config.role_placement import RolePlacement, placement, role_configs
from roll_ds.config.schema import RLVRConfig
from roll_ds.config.similar import close_keys
from roll_ds.platform import device_problems

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """All problems of a config, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config ({len(problems)} problem(s)):\n{lines}")


def to_schema(cfg: DictConfig) -> RLVRConfig:
    """Resolve interpolations and convert to the typed schema; missing values and interpolations
    that do not resolve become errors."""
    unknown = list(_unknown_keys(cfg))
    if unknown:
        raise ConfigError(unknown)
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(
                [f"{key}: required value is missing (???); set it" for key in missing]
            )
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError([_omegaconf_problem(cfg, exc)]) from None
    if not isinstance(obj, RLVRConfig):
        raise ConfigError(
            [
                "config root is not an RLVRConfig: put `- rlvr_config` first in the YAML's "
                "defaults list so Hydra checks it against the schema"
            ]
        )
    return obj


def _unknown_keys(node: DictConfig, prefix: str = "") -> Iterator[str]:
    """Keys of typed sections that their schema does not have. Hydra rejects them, except when
    an override adds them with ``+`` (OmegaConf.to_object would then drop them silently)."""
    schema_type = OmegaConf.get_type(node)
    known = {f.name for f in fields(schema_type)} if is_dataclass(schema_type) else None
    for key in node:
        full_key = f"{prefix}{key}"
        if known is not None and key not in known:
            close = close_keys(str(key), schema_type)
            guess = f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
            yield (
                f"{full_key}: not a key of {schema_type.__name__}{guess}; remove it (a `+` "
                "override adds keys that nothing reads)"
            )
            continue
        if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
            continue
        child = node[key]
        if isinstance(child, DictConfig):
            yield from _unknown_keys(child, f"{full_key}.")


def _omegaconf_problem(cfg: DictConfig, exc: OmegaConfBaseException) -> str:
    """One line for an OmegaConf error while resolving ``cfg``; a DeepSpeed preset that is not
    there gets the list of the ones that are."""
    key = getattr(exc, "full_key", None) or "config"
    problem = f"{key}: {str(exc).splitlines()[0]}"
    if key.endswith("strategy_args.strategy_config"):
        presets = [k for k in cfg if str(k).startswith("deepspeed_") and cfg.get(k) is not None]
        problem += (
            "; the DeepSpeed presets this config pulls in are "
            + ", ".join(f"${{{p}}}" for p in presets)
            + " (another needs `- ../config/<name>@_here_` in the YAML's defaults)"
        )
    return problem


def validate(cfg: RLVRConfig, *, check_files: bool = True) -> list[str]:
    """Raise ``ConfigError`` listing every problem in ``cfg``. Settings without effect, and
    packing that will be slower, are logged as warnings and returned (see the module doc)."""
    warnings = config_warnings(cfg) + packing_warnings(cfg) + generation_cap_warnings(cfg)
    for line in warnings:
        logger.warning("config: %s", line)
    problems: list[str] = []
    problems += pipeline_field_problems(cfg)
    placements: dict[str, RolePlacement] = {}
    for name, role in role_configs(cfg):
        try:
            placements[name] = placement(name, role)
        except ValueError as exc:
            problems.append(str(exc))
        problems += role_problems(cfg, name, role, placements.get(name))
    problems += pipeline_problems(cfg, placements)
    problems += length_problems(cfg, check_files=check_files)
    problems += algorithm_problems(cfg)
    problems += async_problems(cfg)
    problems += component_problems("colocation", cfg)  # roll_ds/pipeline/colocation/checks.py
    problems += component_problems("evaluation", cfg)  # validation sampling, save_best
    problems += device_problems(cfg)
    problems += device_problems_before_start(cfg)  # checks/device.py: what device: auto means
    problems += component_problems("deepspeed", cfg, check_files=check_files)  # ZeRO++, NVMe
    problems += component_problems("sequence_parallel", cfg, check_files=check_files)  # Ulysses
    problems += component_problems("weight_sync_layout", cfg)  # transport vs shared GPUs
    if has_environments(cfg) or cfg.val_env_manager.tags:  # episodes: training or held-out
        problems += component_problems("agentic", cfg)  # roll_ds/agentic/config_checks.py
    if row_groups(cfg) > 0 or not has_environments(cfg):  # dataset rows
        if check_files:
            problems += path_problems(cfg)
        problems += component_problems("data", cfg, check_files=check_files)
    elif check_files:
        problems += model_path_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return warnings
