"""The vllm backend's own config checks, reached by ``roll_ds.config.validate`` through its
``StrategySpec`` (``role_checks``, ``rollout_checks``). Light: no vLLM or torch import
(``strategies.vllm.strategy`` imports neither at module level)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from roll_ds.config.checks.lengths import longest_sequence
from roll_ds.config.schema import RLVRConfig, WorkerConfig
from strategies.vllm.start import seeded_chunking_problem
from strategies.vllm.strategy import OWNED_KWARGS

if TYPE_CHECKING:
    from roll_ds.config.role_placement import RolePlacement


def strategy_config_problems(
    name: str, role: WorkerConfig, where: RolePlacement | None
) -> list[str]:
    """``strategy_config`` of a vllm role: ``vllm.LLM`` keyword arguments, less the ones the
    strategy sets itself."""
    field = f"{name}.strategy_args.strategy_config"
    kwargs = role.strategy_args.strategy_config
    if kwargs is None:
        return []
    if not isinstance(kwargs, Mapping):
        return [
            f"{field}: vllm takes a mapping of vllm.LLM keyword arguments or null, got {kwargs!r}"
        ]
    return [
        f"{field}.{key}: the vllm strategy sets it; remove it (set {owner} instead)"
        for key, owner in OWNED_KWARGS.items()
        if key in kwargs
    ]


def rollout_problems(cfg: RLVRConfig, *, check_files: bool) -> list[str]:
    """The checks of a config whose rollout engine is vllm (``StrategySpec.rollout_checks``)."""
    return model_len_problems(cfg, check_files=check_files) + seeded_sampling_problems(cfg)


def seeded_sampling_problems(cfg: RLVRConfig) -> list[str]:
    """On a CPU cluster (``device: cpu``), no vllm role's strategy_config may let vLLM split a
    prompt over scheduler steps: seeded sampling then crashes (``strategies/vllm/start.py``).
    Under ``device: auto`` the engine refuses the same settings when it starts on CPU."""
    # here, not at the top: roll_ds.config.role_placement imports roll_ds.config
    from roll_ds.config.role_placement import role_configs

    if cfg.device != "cpu":
        return []
    found = []
    for name, role in role_configs(cfg):
        kwargs = role.strategy_args.strategy_config
        if role.strategy_args.strategy_name == "vllm" and isinstance(kwargs, Mapping):
            if name == "actor_infer" and kwargs.get("max_model_len") is None:
                kwargs = {**kwargs, "max_model_len": longest_sequence(cfg)[0]}  # as the engine
            found.append(seeded_chunking_problem(kwargs, f"{name}.strategy_args.strategy_config"))
    return [p for p in found if p is not None]


def model_len_problems(cfg: RLVRConfig, *, check_files: bool) -> list[str]:
    """The longest rollout / evaluation sequence fits the engine's ``max_model_len``: a value
    strategy_config sets must hold it; unset (or null), the strategy sets it to that length
    (``VllmStrategy``), which must fit the model's ``max_position_embeddings``."""
    if cfg.prompt_length < 1:
        return []  # reported by the ranges
    need, how = longest_sequence(cfg)
    kwargs = cfg.actor_infer.strategy_args.strategy_config
    limit = kwargs.get("max_model_len") if isinstance(kwargs, Mapping) else None
    field = "actor_infer.strategy_args.strategy_config.max_model_len"
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            return [f"{field}: must be a whole number of tokens, got {limit!r}"]
        if limit >= need:
            return []
        return [
            f"{field}: {limit} is shorter than the longest sequence ({how} tokens); remove it "
            f"(or set it to null) and the engine gets {need}, raise it to at least {need}, or "
            "lower prompt_length / response_length"
        ]
    path = cfg.actor_infer.model_args.model_name_or_path or cfg.pretrain
    model_dir, where = _model_dir(path, check_files=check_files)
    positions = _max_positions(model_dir) if model_dir is not None else None
    if positions is None or positions >= need:
        return []
    return [
        f"prompt_length + response_length: the longest sequence ({how} tokens), the rollout "
        f"engine's max_model_len, exceeds the model's max_position_embeddings {positions} "
        f"({where}); lower prompt_length / response_length"
    ]


def _model_dir(path: str, *, check_files: bool) -> tuple[str | None, str]:
    """The directory whose config.json the length check reads, and how a message names it: an
    embedded model's shipped directory (package data: read whatever ``check_files`` says), a
    local one only with ``check_files``; None where there is none to read."""
    from roll_ds.models.shipped import EMBEDDED_PREFIX, resolve_embedded

    if path.startswith(EMBEDDED_PREFIX):
        try:
            return resolve_embedded(path), f"{path}'s config.json"
        except (ValueError, FileNotFoundError):
            return None, path  # reported by the model path checks
    return (path if check_files else None), f"{path}/config.json"


def _max_positions(model_dir: str) -> int | None:
    """``max_position_embeddings`` of a local HF model directory; None when unknown or when
    rope scaling stretches it."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("rope_scaling"):
        return None
    positions = config.get("max_position_embeddings")
    return positions if isinstance(positions, int) else None
