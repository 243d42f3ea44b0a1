"""Check a composed pipeline config before any actor starts.

Every problem is collected and reported at once; each line names the field and the fix. Type and
key errors are already caught by Hydra against the schema; this module checks what types cannot:
names that must exist in a registry, device placement, batch arithmetic, cross-role consistency.
Settings that are valid but have no effect (``config_warnings``) are logged as warnings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from roll_ds.config.deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedInputs,
    build_deepspeed_config,
    check_deepspeed_config,
)
from roll_ds.config.device_mapping import DeviceMappingError, parse_device_mapping
from roll_ds.config.estimators import (
    ALWAYS_WHITENED,
    ESTIMATOR_OPTIONS,
    estimators_using,
    needs_critic,
)
from roll_ds.config.schema import (
    DTYPES,
    EMBEDDED_MODEL,
    AlgorithmConfig,
    RewardConfig,
    RLVRConfig,
    WorkerConfig,
)
from strategies.base import STRATEGIES, STRATEGY_SPECS

logger = logging.getLogger(__name__)

# Roles that run on devices (GPUs, or CPU slots on CPU machines) and need a device_mapping.
DEVICE_ROLES = ("actor_train", "actor_infer", "reference", "critic")
# Roles that train on the rollout batch every step.
TRAIN_ROLES = ("actor_train", "critic")


class ConfigError(ValueError):
    """All problems of a config, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config ({len(problems)} problem(s)):\n{lines}")


@dataclass(frozen=True)
class RolePlacement:
    """Where a role's actors go, derived from its config."""

    devices: list[int]
    world_size: int
    devices_per_worker: int


def to_schema(cfg: DictConfig) -> RLVRConfig:
    """Resolve interpolations and convert to the typed schema; missing values become errors."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError([f"{key}: required value is missing (???); set it" for key in missing])
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, RLVRConfig):
        raise ConfigError(
            [
                "config root is not an RLVRConfig: put `- rlvr_config` first in the YAML's "
                "defaults list so Hydra checks it against the schema"
            ]
        )
    return obj


def role_configs(cfg: RLVRConfig) -> Iterator[tuple[str, WorkerConfig]]:
    """``(dotted name, config)`` for every role that is configured and used (a critic only with
    an estimator that reads critic values)."""
    for name in DEVICE_ROLES:
        role = getattr(cfg, name)
        if name == "critic" and not needs_critic(cfg.algorithm.adv_estimator):
            continue
        if role is not None:
            yield name, role
    for domain, reward in cfg.rewards.items():
        yield f"rewards.{domain}", reward


def placement(name: str, role: WorkerConfig) -> RolePlacement:
    """Parse a role's devices and world size (raises ValueError naming the field)."""
    try:
        devices = parse_device_mapping(role.device_mapping)
    except DeviceMappingError as exc:
        raise ValueError(f"{name}.device_mapping: {exc}") from None
    per_worker = role.num_gpus_per_worker
    if per_worker < 1:
        raise ValueError(f"{name}.num_gpus_per_worker: must be >= 1, got {per_worker}")
    if not devices:
        if role.world_size is None or role.world_size < 1:
            raise ValueError(f"{name}.world_size: a role without devices needs world_size >= 1")
        return RolePlacement([], role.world_size, 0)
    if len(devices) % per_worker:
        raise ValueError(
            f"{name}.device_mapping: {len(devices)} devices do not split into workers of "
            f"num_gpus_per_worker={per_worker}; use a multiple of {per_worker} devices"
        )
    world_size = len(devices) // per_worker
    if role.world_size is not None and role.world_size != world_size:
        raise ValueError(
            f"{name}.world_size: {role.world_size} disagrees with device_mapping ({len(devices)} "
            f"devices / num_gpus_per_worker {per_worker} = {world_size}); remove world_size or "
            "make them agree"
        )
    return RolePlacement(devices, world_size, per_worker)


def validate(cfg: RLVRConfig, *, check_files: bool = True) -> list[str]:
    """Raise ``ConfigError`` listing every problem in ``cfg``. Settings without effect are
    logged as warnings (see ``config_warnings``) and returned."""
    warnings = config_warnings(cfg)
    for line in warnings:
        logger.warning("config: %s", line)
    problems: list[str] = []
    problems += _check_cluster(cfg)
    placements: dict[str, RolePlacement] = {}
    for name, role in role_configs(cfg):
        try:
            placements[name] = placement(name, role)
        except ValueError as exc:
            problems.append(str(exc))
        problems += _check_role(cfg, name, role, placements.get(name))
    problems += _check_pipeline(cfg, placements)
    problems += _check_algorithm(cfg)
    if check_files:
        problems += _check_paths(cfg)
    if problems:
        raise ConfigError(problems)
    return warnings


def config_warnings(cfg: RLVRConfig) -> list[str]:
    """Settings that are valid but have no effect with the rest of ``cfg``, one line each naming
    the field and when it does apply."""
    algo = cfg.algorithm
    defaults = {f.name: f.default for f in fields(AlgorithmConfig)}
    estimator = algo.adv_estimator
    if estimator not in ESTIMATOR_OPTIONS:
        return []  # reported as a problem
    warnings = []
    for option in ("gamma", "lam"):
        value = getattr(algo, option)
        if value != defaults[option] and option not in ESTIMATOR_OPTIONS[estimator]:
            warnings.append(
                f"algorithm.{option}={value} has no effect with adv_estimator {estimator!r}; it "
                f"is used by {', '.join(estimators_using(option))}"
            )
    if algo.whiten_advantages and estimator in ALWAYS_WHITENED:
        warnings.append(
            f"algorithm.whiten_advantages has no effect with adv_estimator {estimator!r}, whose "
            "advantages are always whitened"
        )
    if not algo.dynamic_sampling and algo.max_resample_rounds != defaults["max_resample_rounds"]:
        warnings.append(
            f"algorithm.max_resample_rounds={algo.max_resample_rounds} has no effect while "
            "algorithm.dynamic_sampling is false"
        )
    if not needs_critic(estimator):
        critic_users = ", ".join(e for e in sorted(ESTIMATOR_OPTIONS) if needs_critic(e))
        if cfg.critic is not None:
            warnings.append(
                f"critic: configured but adv_estimator {estimator!r} uses no critic; the role is "
                f"not started (it is used by {critic_users})"
            )
        for option in ("value_clip", "vf_coef"):
            value = getattr(algo, option)
            if value != defaults[option]:
                warnings.append(
                    f"algorithm.{option}={value} has no effect with adv_estimator {estimator!r} "
                    f"(no critic); it is used by {critic_users}"
                )
    return warnings


def _check_cluster(cfg: RLVRConfig) -> list[str]:
    problems = []
    if cfg.num_gpus_per_node < 1:
        problems.append(
            f"num_gpus_per_node: must be >= 1, got {cfg.num_gpus_per_node} (devices per node)"
        )
    if cfg.num_nodes < 1:
        problems.append(f"num_nodes: must be >= 1, got {cfg.num_nodes}")
    return problems


def _check_role(
    cfg: RLVRConfig, name: str, role: WorkerConfig, where: RolePlacement | None
) -> list[str]:
    problems = []
    strategy = role.strategy_args.strategy_name
    is_device_role = name in DEVICE_ROLES
    if strategy is None:
        if is_device_role:
            problems.append(
                f"{name}.strategy_args.strategy_name: required; valid: "
                + ", ".join(STRATEGIES.names())
            )
    elif strategy not in STRATEGIES:
        unknown = STRATEGIES.unknown_message(strategy)
        problems.append(f"{name}.strategy_args.strategy_name: {unknown}")
    else:
        spec = STRATEGY_SPECS[strategy]
        if name in ("actor_train", "critic") and not spec.trains:
            trainers = [n for n, s in STRATEGY_SPECS.items() if s.trains]
            problems.append(
                f"{name}.strategy_args.strategy_name: {strategy!r} cannot train; use one of "
                f"{', '.join(trainers)}"
            )
        if name == "actor_infer" and not spec.generates:
            generators = [n for n, s in STRATEGY_SPECS.items() if s.generates]
            problems.append(
                f"{name}.strategy_args.strategy_name: {strategy!r} cannot generate rollouts; use "
                f"one of {', '.join(generators)}"
            )
        if strategy.startswith("deepspeed"):
            problems += _check_deepspeed(name, role, where)

    if where is not None:
        if is_device_role and not where.devices:
            problems.append(
                f"{name}.device_mapping: the role has no devices; give it some, e.g. "
                "device_mapping: list(range(0,2))"
            )
        total = cfg.num_nodes * cfg.num_gpus_per_node
        beyond = [d for d in where.devices if d >= total]
        if beyond and cfg.num_gpus_per_node >= 1 and cfg.num_nodes >= 1:
            problems.append(
                f"{name}.device_mapping: device ids {beyond} are beyond the cluster "
                f"(num_nodes {cfg.num_nodes} x num_gpus_per_node {cfg.num_gpus_per_node} = "
                f"{total} devices, ids 0-{total - 1}); lower the ids or raise num_nodes"
            )
        elif where.devices_per_worker > 1 and cfg.num_gpus_per_node >= 1:
            for start in range(0, len(where.devices), where.devices_per_worker):
                group = where.devices[start : start + where.devices_per_worker]
                if len({d // cfg.num_gpus_per_node for d in group}) > 1:
                    problems.append(
                        f"{name}.device_mapping: worker devices {group} span two nodes; the "
                        f"num_gpus_per_worker={where.devices_per_worker} devices of a worker must "
                        "sit on one node"
                    )
                    break

    if isinstance(role, RewardConfig):
        from roll_ds.rewards.registry import validate_reward_specs

        problems += [f"{name}.{p}" for p in validate_reward_specs(list(role.reward_fns))]
        if not role.tag_included:
            problems.append(f"{name}.tag_included: list the data domains this role scores")

    dtype = role.model_args.dtype
    if dtype not in DTYPES:
        problems.append(f"{name}.model_args.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    rank = role.model_args.lora_rank
    if rank is not None and rank < 1:
        problems.append(f"{name}.model_args.lora_rank: must be >= 1 or null (no LoRA), got {rank}")
    if role.infer_batch_size < 1:
        problems.append(f"{name}.infer_batch_size: must be >= 1, got {role.infer_batch_size}")
    return problems


def _check_deepspeed(name: str, role: WorkerConfig, where: RolePlacement | None) -> list[str]:
    field = f"{name}.strategy_args.strategy_config"
    ds = role.strategy_args.strategy_config
    if not isinstance(ds, dict):
        return [
            f"{field}: a DeepSpeed config is required, e.g. strategy_config: ${{deepspeed_zero3}} "
            "with `- ../config/deepspeed_zero3@_here_` in defaults"
        ]
    problems = check_deepspeed_config(ds, field)
    if problems or where is None or not where.devices:
        return problems
    args = role.training_args
    inputs = DeepSpeedInputs(
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dp_size=where.world_size,
        max_grad_norm=args.max_grad_norm,
        dtype=role.model_args.dtype,
    )
    try:
        build_deepspeed_config(ds, inputs)
    except DeepSpeedConfigError as exc:
        problems += [line.replace("strategy_config", field, 1) for line in str(exc).splitlines()]
    return problems


def _check_pipeline(cfg: RLVRConfig, placements: dict[str, RolePlacement]) -> list[str]:
    problems = []
    for key in ("max_steps", "rollout_batch_size", "num_return_sequences_in_group"):
        if getattr(cfg, key) < 1:
            problems.append(f"{key}: must be >= 1, got {getattr(cfg, key)}")
    for key in ("prompt_length", "response_length"):
        if getattr(cfg, key) < 1:
            problems.append(f"{key}: must be >= 1, got {getattr(cfg, key)}")

    group = cfg.num_return_sequences_in_group
    infer_n = cfg.actor_infer.generating_args.num_return_sequences
    if infer_n != group:
        problems.append(
            f"actor_infer.generating_args.num_return_sequences: {infer_n} != "
            f"num_return_sequences_in_group {group}; set it to ${{num_return_sequences_in_group}}"
        )
    for name in TRAIN_ROLES:
        train = placements.get(name)
        if train is None or train.world_size < 1 or cfg.rollout_batch_size < 1 or group < 1:
            continue
        args = getattr(cfg, name).training_args
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        step_samples = per_step * train.world_size
        samples = cfg.rollout_batch_size * group
        if samples % step_samples:
            problems.append(
                f"rollout_batch_size x num_return_sequences_in_group = {cfg.rollout_batch_size} x "
                f"{group} = {samples} samples per step is not a multiple of {name}'s "
                f"train batch ({name}.training_args: per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps} x world size {train.world_size} = "
                f"{step_samples}); adjust one of them"
            )
    lora = cfg.actor_train.model_args.lora_rank is not None
    algo = cfg.algorithm
    if algo.kl_coef > 0 and not lora and cfg.reference is None:
        problems.append(
            "reference: algorithm.kl_coef > 0 needs reference log-probs; configure `reference:` "
            "or use LoRA (the adapter-disabled actor is the reference)"
        )
    from roll_ds.weight_sync import check_transport_name

    try:
        check_transport_name(cfg.weight_sync.transport)
    except ValueError as exc:
        problems.append(str(exc).replace("unknown weight_sync.transport", "weight_sync.transport:"))
    problems += _check_lora_sync(cfg)
    if not cfg.rewards:
        problems.append("rewards: no reward role; add e.g. rewards.math with reward_fns")
    return problems


def _check_lora_sync(cfg: RLVRConfig) -> list[str]:
    """``weight_sync.lora_sync: adapter`` needs a LoRA policy, a vLLM rollout engine that
    serves its rank, and the same base model on both sides (only the adapter travels)."""
    from roll_ds.weight_sync.adapter import check_lora_sync

    try:
        if check_lora_sync(cfg.weight_sync.lora_sync) != "adapter":
            return []
    except ValueError as exc:
        return [str(exc)]
    problems = []
    train, infer = cfg.actor_train, cfg.actor_infer
    rank = train.model_args.lora_rank
    if rank is None:
        problems.append(
            "weight_sync.lora_sync: adapter needs a LoRA policy (actor_train.model_args."
            "lora_rank); use lora_sync=merged for full fine-tuning"
        )
    elif rank > 512:
        problems.append(
            f"weight_sync.lora_sync: adapter: vLLM serves LoRA ranks up to 512, "
            f"actor_train.model_args.lora_rank is {rank}; use lora_sync=merged"
        )
    if infer.strategy_args.strategy_name != "vllm":
        problems.append(
            f"weight_sync.lora_sync: adapter needs actor_infer.strategy_args.strategy_name vllm "
            f"(got {infer.strategy_args.strategy_name!r}); use lora_sync=merged"
        )
    bases = (train.model_args.model_name_or_path, infer.model_args.model_name_or_path)
    if bases[0] != bases[1]:
        problems.append(
            "weight_sync.lora_sync: adapter ships only the adapter, so actor_infer must load the "
            f"trainer's base model: actor_train.model_args.model_name_or_path is {bases[0]!r}, "
            f"actor_infer's {bases[1]!r}; make them equal (or null for pretrain)"
        )
    return problems


def _check_algorithm(cfg: RLVRConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    if algo.adv_estimator not in ESTIMATOR_OPTIONS:
        problems.append(
            f"algorithm.adv_estimator: unknown advantage estimator {algo.adv_estimator!r}; valid: "
            + ", ".join(sorted(ESTIMATOR_OPTIONS))
        )
    elif needs_critic(algo.adv_estimator) and cfg.critic is None:
        problems.append(
            f"critic: adv_estimator {algo.adv_estimator!r} needs a critic role (the value model); "
            "configure `critic:` with strategy deepspeed_train (see "
            "examples/qwen_rlvr/rlvr_ppo_gae_zero3.yaml)"
        )
    if algo.ppo_epochs < 1:
        problems.append(f"algorithm.ppo_epochs: must be >= 1, got {algo.ppo_epochs}")
    for key in ("gamma", "lam"):
        value = getattr(algo, key)
        if not 0.0 <= value <= 1.0:
            problems.append(f"algorithm.{key}: must be in [0, 1], got {value}")
    if algo.value_clip is not None and algo.value_clip <= 0:
        problems.append(
            f"algorithm.value_clip: must be > 0 (or null: no value clipping), got {algo.value_clip}"
        )
    if algo.vf_coef <= 0:
        problems.append(f"algorithm.vf_coef: must be > 0, got {algo.vf_coef}")
    return problems


def _check_paths(cfg: RLVRConfig) -> list[str]:
    problems = []
    pretrain = cfg.pretrain
    if not pretrain.startswith("embedded:") and not Path(pretrain).exists():
        problems.append(
            f"pretrain: {pretrain!r} does not exist; point it at a local model directory "
            f"(no model hub is reachable at run time) or use {EMBEDDED_MODEL!r}"
        )
    for where, data in (
        ("actor_train.data_args", cfg.actor_train.data_args),
        ("validation.data_args", cfg.validation.data_args),
    ):
        for i, path in enumerate(data.file_name):
            if not Path(path).is_file():
                problems.append(f"{where}.file_name[{i}]: file {path!r} not found")
    if not cfg.actor_train.data_args.file_name:
        problems.append("actor_train.data_args.file_name: no training data; list jsonl files")
    return problems
