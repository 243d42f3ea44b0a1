"""The DeepSpeed backends' own config checks (deepspeed_train, deepspeed_infer), reached by
``roll_ds.config.validate`` through their ``StrategySpec.role_checks`` (each role's config) and
the ``deepspeed`` component check (``deepspeed_run_problems``: what needs the whole config, the
device and the disk). Light: no DeepSpeed or torch import; the config builder they run is the
core's (``roll_ds.config.deepspeed``)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from roll_ds.config.deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedInputs,
    build_deepspeed_config,
    check_deepspeed_config,
    fp16_train_problems,
    nvme_paths,
    precision_problems,
    role_nvme_dir,
)
from roll_ds.config.schema import RLVRConfig, WorkerConfig
from roll_ds.config.zeropp import zeropp_device_problems, zeropp_topology_problems

if TYPE_CHECKING:
    from roll_ds.config.role_placement import RolePlacement

logger = logging.getLogger(__name__)

DEEPSPEED_STRATEGIES = ("deepspeed_train", "deepspeed_infer")
# What the role check builds with where the value needs the disk or the model: the NVMe
# component check (deepspeed_run_problems) checks the real ones.
NVME_DIR_PLACEHOLDER = "<nvme_path: auto>"


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
    problems += precision_problems(ds, field, name, role.model_args.dtype)
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
        nvme_dir=NVME_DIR_PLACEHOLDER,
        largest_numel=1,
    )
    try:
        built = build_deepspeed_config(ds, inputs)
    except DeepSpeedConfigError as exc:
        problems += [line.replace("strategy_config", field, 1) for line in str(exc).splitlines()]
        return problems
    if role.strategy_args.strategy_name == "deepspeed_train":
        problems += fp16_train_problems(built, field)
    return problems


def deepspeed_roles(cfg: RLVRConfig) -> Iterator[tuple[str, WorkerConfig, dict]]:
    """``(name, role, strategy_config)`` of the used roles a DeepSpeed backend runs."""
    from roll_ds.config.role_placement import role_configs

    for name, role in role_configs(cfg):
        ds = role.strategy_args.strategy_config
        if role.strategy_args.strategy_name in DEEPSPEED_STRATEGIES and isinstance(ds, dict):
            yield name, role, ds


def preset_of(cfg: RLVRConfig, ds: dict) -> str | None:
    """The name of the preset (``deepspeed_zero3``, ...) a role's DeepSpeed config is, if it is
    one unchanged."""
    presets = (f for f in type(cfg).__dataclass_fields__ if f.startswith("deepspeed_"))
    return next((name for name in presets if getattr(cfg, name) == ds), None)


def ranks_per_node(cfg: RLVRConfig, role: WorkerConfig) -> list[int]:
    """The role's ranks on each node it uses (device id // num_gpus_per_node is the node); []
    when its placement does not parse (reported by the role checks)."""
    from roll_ds.config.role_placement import placement

    try:
        where = placement("role", role)
    except ValueError:
        return []
    if not where.devices or cfg.num_gpus_per_node < 1:
        return []
    per_node = Counter(d // cfg.num_gpus_per_node for d in where.devices)
    return [n // where.devices_per_worker for n in per_node.values()]


def deepspeed_run_problems(cfg: RLVRConfig, *, check_files: bool = True) -> list[str]:
    """ZeRO++ against the device and the nodes, and (``check_files``) each section against
    DeepSpeed's own config models (``ds_models.py``: imports DeepSpeed) and NVMe offload against
    libaio and the disk (``strategies/deepspeed/nvme.py``), for every DeepSpeed role. A memory
    file system under an ``nvme_path`` is logged as a warning."""
    problems = deepspeed_device_problems(cfg)
    for name, role, ds in deepspeed_roles(cfg):
        field = f"{name}.strategy_args.strategy_config"
        problems += zeropp_topology_problems(ds, field, ranks_per_node(cfg, role))
        if nvme_paths(ds):
            problems += nvme_buffer_problems(cfg, role, ds, field, check_files=check_files)
        if check_files:
            from strategies.deepspeed.ds_models import deepspeed_model_problems

            problems += deepspeed_model_problems(ds, field, preset_of(cfg, ds))
        if check_files and nvme_paths(ds):
            found, warnings = role_nvme_problems(cfg, name, role, ds)
            problems += found
            for line in warnings:
                logger.warning("config: %s", line)
    return problems


def deepspeed_device_problems(cfg: RLVRConfig) -> list[str]:
    """What the DeepSpeed roles cannot do on ``cfg.device`` (ZeRO++'s CUDA kernels on cpu); the
    ``deepspeed_device`` component check, run for what ``device: auto`` resolves to as well."""
    return [
        problem
        for name, _, ds in deepspeed_roles(cfg)
        for problem in zeropp_device_problems(
            ds, f"{name}.strategy_args.strategy_config", cfg.device
        )
    ]


def role_nvme_problems(
    cfg: RLVRConfig, name: str, role: WorkerConfig, ds: dict
) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of role ``name``'s NVMe offload, sized from its model's
    safetensors (an unreadable model: the room is not checked)."""
    from roll_ds.models.shipped import EMBEDDED_PREFIX, resolve_embedded
    from strategies.deepspeed import nvme

    path = role.model_args.model_name_or_path or cfg.pretrain
    try:
        model_dir = resolve_embedded(path) if path.startswith(EMBEDDED_PREFIX) else path
    except (ValueError, FileNotFoundError):
        model_dir = None  # reported by the model path checks
    size = nvme.model_size(model_dir) if model_dir and os.path.isdir(model_dir) else None
    args = role.model_args
    trained = None  # every parameter
    if role.strategy_args.strategy_name != "deepspeed_train":
        trained = 0  # no optimizer
    elif args.lora_rank is not None and size is not None:
        trained = size.adapter_numel(args.lora_rank, args.lora_target)
    nodes = ranks_per_node(cfg, role)
    share = max(nodes) / sum(nodes) if nodes else 1.0
    return nvme.ds_nvme_problems(
        ds,
        f"{name}.strategy_args.strategy_config",
        nvme_dir=role_nvme_dir(cfg.output_dir, cfg.exp_name, name),
        size=size,
        trained_numel=trained,
        dtype=args.dtype,
        share=share,
    )


def nvme_buffer_problems(
    cfg: RLVRConfig, role: WorkerConfig, ds: dict, field: str, *, check_files: bool
) -> list[str]:
    """The NVMe swap buffers' and aio's sizes of a role (``strategies/deepspeed/nvme.py``
    ``buffer_problems``); the largest parameter is read from the model's safetensors headers
    (``check_files``)."""
    from roll_ds.config.role_placement import placement
    from roll_ds.models.shipped import EMBEDDED_PREFIX, resolve_embedded
    from strategies.deepspeed import nvme

    largest = None
    path = role.model_args.model_name_or_path or cfg.pretrain
    if check_files or path.startswith(EMBEDDED_PREFIX):
        try:
            model_dir = resolve_embedded(path) if path.startswith(EMBEDDED_PREFIX) else path
            size = nvme.model_size(model_dir) if os.path.isdir(model_dir) else None
        except (ValueError, OSError):
            size = None  # reported by the model path checks
        largest = size.largest_numel if size is not None else None
    try:
        dp_size = placement("role", role).world_size
    except ValueError:
        return []  # reported by the role checks
    nodes = ranks_per_node(cfg, role)
    return nvme.buffer_problems(
        ds,
        field,
        largest_numel=largest,
        dp_size=dp_size,
        dtype=role.model_args.dtype,
        ranks_on_node=max(nodes) if nodes else dp_size,
        host_bytes=nvme.host_memory_bytes(),
    )
