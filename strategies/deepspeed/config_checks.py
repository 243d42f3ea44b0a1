"""The DeepSpeed backends' own config checks (deepspeed_train, deepspeed_infer), reached by
``roll_ds.config.validate`` through their ``StrategySpec.role_checks``. Light: no DeepSpeed or
torch import; the config builder they run is the core's (``roll_ds.config.deepspeed``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from roll_ds.config.deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedInputs,
    build_deepspeed_config,
    check_deepspeed_config,
    fp16_train_problems,
)
from roll_ds.config.schema import WorkerConfig

if TYPE_CHECKING:
    from roll_ds.config.role_placement import RolePlacement


def strategy_config_problems(
    name: str, role: WorkerConfig, where: RolePlacement | None
) -> list[str]:
    """The role's DeepSpeed config is there, well-formed, and builds with its batch sizes and
    data-parallel size (``where``: the role's placement, None when that did not parse)."""
    field = f"{name}.strategy_args.strategy_config"
    ds = role.strategy_args.strategy_config
    if not isinstance(ds, dict):
        return [
            f"{field}: a DeepSpeed config is required, e.g. strategy_config: ${{deepspeed_zero3}} "
            "with `- ../config/deepspeed_zero3@_here_` in defaults"
        ]
    problems = check_deepspeed_config(ds, field)
    args = role.training_args
    batch_ok = min(args.per_device_train_batch_size, args.gradient_accumulation_steps) >= 1
    if problems or where is None or not where.devices or not batch_ok:
        return problems  # bad batch sizes are reported by the training_args ranges
    inputs = DeepSpeedInputs(
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dp_size=where.world_size,
        max_grad_norm=args.max_grad_norm,
        dtype=role.model_args.dtype,
    )
    try:
        built = build_deepspeed_config(ds, inputs)
    except DeepSpeedConfigError as exc:
        problems += [line.replace("strategy_config", field, 1) for line in str(exc).splitlines()]
        return problems
    if role.strategy_args.strategy_name == "deepspeed_train":
        problems += fp16_train_problems(built, field)
    return problems
