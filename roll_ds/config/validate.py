"""Check a composed pipeline config before any actor starts.

Every problem is collected and reported at once; each line names the field and the fix. Type and
key errors are already caught by Hydra against the schema; the allowed values of each scalar field
are tables in ``ranges.py``; this module applies them and checks what neither can: names that must
exist in a registry, device placement, batch arithmetic, lengths against the rollout engine,
cross-role consistency. Settings that are valid but have no effect (``no_effect.config_warnings``)
are logged as warnings.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from roll_ds.config import ranges
from roll_ds.config.deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedInputs,
    build_deepspeed_config,
    check_deepspeed_config,
)
from roll_ds.config.device_mapping import DeviceMappingError, parse_device_mapping
from roll_ds.config.estimators import ESTIMATOR_OPTIONS, needs_critic
from roll_ds.config.hints import close_keys
from roll_ds.config.no_effect import config_warnings
from roll_ds.config.schema import (
    EMBEDDED_MODEL,
    ModelArgs,
    RewardConfig,
    RLVRConfig,
    WorkerConfig,
)
from roll_ds.data.sources import data_problems
from roll_ds.pipeline.colocation import colocation_problems
from roll_ds.pipeline.eval_metrics import eval_config_problems
from roll_ds.platform import device_problems
from roll_ds.weight_sync.select import layout_problems
from strategies.base import STRATEGIES, STRATEGY_SPECS

logger = logging.getLogger(__name__)

# Roles that run on devices (GPUs, or CPU slots on CPU machines) and need a device_mapping.
DEVICE_ROLES = ("actor_train", "actor_infer", "reference", "critic")
# Roles that train on the rollout batch every step.
TRAIN_ROLES = ("actor_train", "critic")
# Embedding and output-head modules: LoRA on them is not merged into the weights that reach the
# rollout engine (roll_ds.models.lora.weight_units merges the LoRA of linear layers, and an output
# head tied to the embedding is re-emitted from the embedding's weight).
EMBEDDING_MODULES = (
    "embed_tokens",
    "lm_head",
    "wte",
    "wpe",
    "word_embeddings",
    "embed_in",
    "embed_out",
)


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
    problems += _check_fields(cfg)
    placements: dict[str, RolePlacement] = {}
    for name, role in role_configs(cfg):
        try:
            placements[name] = placement(name, role)
        except ValueError as exc:
            problems.append(str(exc))
        problems += _check_role(cfg, name, role, placements.get(name))
    problems += _check_pipeline(cfg, placements)
    problems += _check_lengths(cfg, check_files=check_files)
    problems += _check_algorithm(cfg)
    problems += _check_async(cfg)
    problems += colocation_problems(cfg)  # roll_ds/pipeline/colocation.py
    problems += eval_config_problems(cfg)  # validation sampling fields, save_best
    problems += device_problems(cfg)
    problems += layout_problems(cfg)  # weight_sync.transport vs shared GPUs (weight_sync/select.py)
    if check_files:
        problems += _check_paths(cfg)
    problems += data_problems(cfg, check_files=check_files)  # keys, formats, files
    if problems:
        raise ConfigError(problems)
    return warnings


# --- problems ------------------------------------------------------------------------------


def _check_fields(cfg: RLVRConfig) -> list[str]:
    """The pipeline-wide sections' scalar fields against their ranges (``ranges.py``); the
    roles' are checked by ``_role_fields``."""
    sections = [
        ("", cfg, ranges.PIPELINE),
        ("algorithm", cfg.algorithm, ranges.ALGORITHM),
        ("async_generation", cfg.async_generation, ranges.ASYNC_GENERATION),
        ("weight_sync", cfg.weight_sync, ranges.WEIGHT_SYNC),
        ("ray", cfg.ray, ranges.RAY),
        ("tracking", cfg.tracking, ranges.TRACKING),
        ("validation", cfg.validation, ranges.VALIDATION),
        ("validation.generating_args", cfg.validation.generating_args, ranges.GENERATING_ARGS),
        ("validation.data_args", cfg.validation.data_args, ranges.DATA_ARGS),
    ]
    problems = []
    for prefix, section, rules in sections:
        problems += ranges.field_problems(prefix, section, rules)
    return problems


def _role_fields(name: str, role: WorkerConfig) -> list[str]:
    """A role's scalar fields against their ranges; only the sections the role reads."""
    sections = [("", role, ranges.WORKER), ("model_args", role.model_args, ranges.MODEL_ARGS)]
    if name in TRAIN_ROLES:
        sections.append(("training_args", role.training_args, ranges.TRAINING_ARGS))
    if name == "actor_infer":
        sections.append(("generating_args", role.generating_args, ranges.GENERATING_ARGS))
    if name == "actor_train":
        sections.append(("data_args", role.data_args, ranges.DATA_ARGS))
    if isinstance(role, RewardConfig):
        sections.append(("", role, ranges.REWARD))
    problems = []
    for prefix, section, rules in sections:
        problems += ranges.field_problems(f"{name}.{prefix}".rstrip("."), section, rules)
    return problems


def _check_role(
    cfg: RLVRConfig, name: str, role: WorkerConfig, where: RolePlacement | None
) -> list[str]:
    problems = _check_strategy(name, role, where)
    if where is not None:
        problems += _check_devices(cfg, name, where)
    if isinstance(role, RewardConfig):
        problems += _check_reward(name, role)
    problems += _role_fields(name, role)
    problems += _check_lora_target(name, role.model_args)
    return problems


def _check_strategy(name: str, role: WorkerConfig, where: RolePlacement | None) -> list[str]:
    strategy = role.strategy_args.strategy_name
    field = f"{name}.strategy_args.strategy_name"
    if strategy is None:
        if name in DEVICE_ROLES:
            return [f"{field}: required; valid: " + ", ".join(STRATEGIES.names())]
        return []
    if strategy not in STRATEGIES:
        return [f"{field}: {STRATEGIES.unknown_message(strategy)}"]
    problems = []
    spec = STRATEGY_SPECS[strategy]
    if name in TRAIN_ROLES and not spec.trains:
        trainers = [n for n, s in STRATEGY_SPECS.items() if s.trains]
        problems.append(f"{field}: {strategy!r} cannot train; use one of {', '.join(trainers)}")
    if name == "actor_infer" and not spec.generates:
        generators = [n for n, s in STRATEGY_SPECS.items() if s.generates]
        problems.append(
            f"{field}: {strategy!r} cannot generate rollouts; use one of {', '.join(generators)}"
        )
    if strategy.startswith("deepspeed"):
        problems += _check_deepspeed(name, role, where)
    if strategy == "vllm":
        problems += _check_vllm(name, role)
    return problems


def _check_devices(cfg: RLVRConfig, name: str, where: RolePlacement) -> list[str]:
    if name in DEVICE_ROLES and not where.devices:
        return [
            f"{name}.device_mapping: the role has no devices; give it some, e.g. "
            "device_mapping: list(range(0,2))"
        ]
    per_node = cfg.num_gpus_per_node
    if per_node < 1 or cfg.num_nodes < 1:
        return []  # reported by _check_fields
    total = cfg.num_nodes * per_node
    beyond = [d for d in where.devices if d >= total]
    if beyond:
        return [
            f"{name}.device_mapping: device ids {beyond} are beyond the cluster "
            f"(num_nodes {cfg.num_nodes} x num_gpus_per_node {per_node} = "
            f"{total} devices, ids 0-{total - 1}); lower the ids or raise num_nodes"
        ]
    size = where.devices_per_worker
    if size <= 1:
        return []
    for start in range(0, len(where.devices), size):
        group = where.devices[start : start + size]
        if len({d // per_node for d in group}) > 1:
            return [
                f"{name}.device_mapping: worker devices {group} span two nodes; the "
                f"num_gpus_per_worker={size} devices of a worker must sit on one node"
            ]
    return []


def _check_reward(name: str, role: RewardConfig) -> list[str]:
    from roll_ds.rewards.model_reward import check_model_reward
    from roll_ds.rewards.registry import validate_reward_specs

    problems = [f"{name}.{p}" for p in validate_reward_specs(list(role.reward_fns))]
    problems += check_model_reward(name, role)  # reward model / judge (rewards/model_reward.py)
    if not role.tag_included:
        problems.append(f"{name}.tag_included: list the data domains this role scores")
    return problems


def _check_lora_target(name: str, model: ModelArgs) -> list[str]:
    """A LoRA target list that is empty, or that names embedding / output-head modules on the
    policy (their LoRA would never reach the rollout engine)."""
    if model.lora_rank is None:
        return []
    field = f"{name}.model_args.lora_target"
    targets = [t.strip() for t in model.lora_target.split(",") if t.strip()]
    if not targets:
        return [f"{field}: empty; use 'all-linear' or a comma list such as 'q_proj,v_proj'"]
    embeddings = [t for t in targets if t.rsplit(".", 1)[-1] in EMBEDDING_MODULES]
    if name != "actor_train" or not embeddings:
        return []
    return [
        f"{field}: LoRA on {', '.join(embeddings)} (an embedding, or an output head tied to one) "
        "is not merged into the weights synced to the rollout engine, so rollouts would not see "
        f"it; remove {'it' if len(embeddings) == 1 else 'them'} from lora_target ('all-linear' "
        "leaves embeddings and the head out)"
    ]


def _check_deepspeed(name: str, role: WorkerConfig, where: RolePlacement | None) -> list[str]:
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
        build_deepspeed_config(ds, inputs)
    except DeepSpeedConfigError as exc:
        problems += [line.replace("strategy_config", field, 1) for line in str(exc).splitlines()]
    return problems


def _check_vllm(name: str, role: WorkerConfig) -> list[str]:
    """``strategy_config`` of a vllm role: ``vllm.LLM`` keyword arguments, less the ones the
    strategy sets itself."""
    from strategies.vllm import OWNED_KWARGS

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


def _check_pipeline(cfg: RLVRConfig, placements: dict[str, RolePlacement]) -> list[str]:
    group = cfg.num_return_sequences_in_group
    infer_n = cfg.actor_infer.generating_args.num_return_sequences
    problems = []
    if infer_n != group:
        problems.append(
            f"actor_infer.generating_args.num_return_sequences: {infer_n} != "
            f"num_return_sequences_in_group {group}; set it to ${{num_return_sequences_in_group}}"
        )
    for name in TRAIN_ROLES:
        if name in placements:
            problems += _check_train_batch(cfg, name, placements[name])
    lora = cfg.actor_train.model_args.lora_rank is not None
    if cfg.algorithm.kl_coef > 0 and not lora and cfg.reference is None:
        problems.append(
            "reference: algorithm.kl_coef > 0 needs reference log-probs; configure "
            "`reference:` or use LoRA (the adapter-disabled actor is the reference)"
        )
    from roll_ds.weight_sync import check_transport_name

    try:
        check_transport_name(cfg.weight_sync.transport)
    except ValueError as exc:
        problems.append(str(exc).replace("unknown weight_sync.transport", "weight_sync.transport:"))
    problems += _check_lora_sync(cfg)
    if not cfg.rewards:
        problems.append("rewards: no reward role; add e.g. rewards.math with reward_fns")
    problems += _check_domains(cfg)
    return problems


def _check_train_batch(cfg: RLVRConfig, name: str, train: RolePlacement) -> list[str]:
    """The step's samples must split into whole optimizer steps of the role."""
    args = getattr(cfg, name).training_args
    group = cfg.num_return_sequences_in_group
    sizes = (args.per_device_train_batch_size, args.gradient_accumulation_steps, train.world_size)
    if min(*sizes, cfg.rollout_batch_size, group) < 1:
        return []  # reported by the ranges (a zero here was a ZeroDivisionError)
    step_samples = sizes[0] * sizes[1] * sizes[2]
    samples = cfg.rollout_batch_size * group
    if samples % step_samples == 0:
        return []
    return [
        f"rollout_batch_size x num_return_sequences_in_group = {cfg.rollout_batch_size} x "
        f"{group} = {samples} samples per step is not a multiple of {name}'s "
        f"train batch ({name}.training_args: per_device_train_batch_size "
        f"{args.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{args.gradient_accumulation_steps} x world size {train.world_size} = "
        f"{step_samples}); adjust one of them"
    ]


def _check_domains(cfg: RLVRConfig) -> list[str]:
    """Each domain is scored by one reward role; sampled domains have a reward role; held-out
    data exists when evaluation is on."""
    problems = []
    owner: dict[str, str] = {}
    for role_name, reward in cfg.rewards.items():
        for tag in reward.tag_included:
            if tag in owner:
                problems.append(
                    f"rewards.{role_name}.tag_included: domain {tag!r} is also in "
                    f"rewards.{owner[tag]}.tag_included; score each domain with one role"
                )
            owner.setdefault(tag, role_name)
    field = "actor_train.data_args.domain_interleave_probs"
    weights = cfg.actor_train.data_args.domain_interleave_probs
    if any(not w >= 0 for w in weights.values()) or (weights and sum(weights.values()) <= 0):
        problems.append(
            f"{field}: weights must be >= 0 with a positive sum, got {dict(weights)}; or leave it "
            "empty (domains in proportion to the data)"
        )
    unscored = sorted(d for d, w in weights.items() if w > 0 and d not in owner)
    if unscored and cfg.rewards:
        problems.append(
            f"{field}: domains {unscored} are scored by no reward role; add them to a "
            "rewards.<name>.tag_included"
        )
    if cfg.eval_steps > 0 and not cfg.validation.data_args.file_name:
        problems.append(
            f"validation.data_args.file_name: eval_steps={cfg.eval_steps} evaluates on held-out "
            "data but no file is listed; list jsonl files or set eval_steps=0"
        )
    return problems


def _check_lengths(cfg: RLVRConfig, *, check_files: bool) -> list[str]:
    """Generation lengths against response_length and the rollout engine's context."""
    problems = []
    response = cfg.response_length
    new_tokens = cfg.actor_infer.generating_args.max_new_tokens
    if new_tokens is not None and new_tokens > response:
        problems.append(
            f"actor_infer.generating_args.max_new_tokens: {new_tokens} > response_length "
            f"{response}; rollouts must fit response_length (the loss normalization and the "
            "overlong penalty count on it): set it to ${response_length} or null"
        )
    if cfg.algorithm.overlong_buffer_len > response:
        problems.append(
            f"algorithm.overlong_buffer_len: {cfg.algorithm.overlong_buffer_len} > "
            f"response_length {response}; the penalty window is the end of the response: "
            "lower it"
        )
    if cfg.actor_infer.strategy_args.strategy_name == "vllm" and cfg.prompt_length >= 1:
        problems += _check_model_len(cfg, check_files=check_files)
    return problems


def _longest_sequence(cfg: RLVRConfig) -> tuple[int, str]:
    """Tokens a rollout (or evaluation) sequence can reach, and how that adds up."""
    lengths = [(cfg.response_length, "response_length")]
    gens = [("actor_infer", cfg.actor_infer.generating_args)]
    if cfg.eval_steps:
        gens.append(("validation", cfg.validation.generating_args))
    for where, gen in gens:
        if gen.max_new_tokens is not None:
            lengths.append((gen.max_new_tokens, f"{where}.generating_args.max_new_tokens"))
    longest, name = max(lengths, key=lambda length: length[0])  # ties: response_length
    total = cfg.prompt_length + longest
    return total, f"prompt_length {cfg.prompt_length} + {name} {longest} = {total}"


def _check_model_len(cfg: RLVRConfig, *, check_files: bool) -> list[str]:
    need, how = _longest_sequence(cfg)
    kwargs = cfg.actor_infer.strategy_args.strategy_config
    limit = kwargs.get("max_model_len") if isinstance(kwargs, Mapping) else None
    field = "actor_infer.strategy_args.strategy_config.max_model_len"
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            return [f"{field}: must be a whole number of tokens, got {limit!r}"]
        if limit >= need:
            return []
        return [
            f"{field}: {limit} is shorter than the longest sequence ({how} tokens); raise it to "
            f"at least {need} or lower prompt_length / response_length"
        ]
    path = cfg.actor_infer.model_args.model_name_or_path or cfg.pretrain
    positions = _max_positions(path) if check_files else None
    if positions is None or positions >= need:
        return []
    return [
        f"prompt_length + response_length: the longest sequence ({how} tokens) exceeds the "
        f"model's max_position_embeddings {positions} ({path}/config.json), which vLLM takes "
        "as max_model_len; lower prompt_length / response_length"
    ]


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
    if algo.adv_estimator not in ESTIMATOR_OPTIONS:
        return [
            f"algorithm.adv_estimator: unknown advantage estimator {algo.adv_estimator!r}; valid: "
            + ", ".join(sorted(ESTIMATOR_OPTIONS))
        ]
    if needs_critic(algo.adv_estimator) and cfg.critic is None:
        return [
            f"critic: adv_estimator {algo.adv_estimator!r} needs a critic role (the value model); "
            "configure `critic:` with strategy deepspeed_train (see "
            "examples/qwen_rlvr/rlvr_ppo_gae_zero3.yaml)"
        ]
    return []


def _check_async(cfg: RLVRConfig) -> list[str]:
    """``async_generation``: what the asynchronous loop does not do (yet)."""
    if cfg.async_generation.max_staleness < 1:
        return []
    problems = []
    if cfg.algorithm.dynamic_sampling:
        problems.append(
            "async_generation.max_staleness: algorithm.dynamic_sampling resamples within a step, "
            "which the asynchronous loop does not do; set async_generation.max_staleness=0 or "
            "algorithm.dynamic_sampling=false"
        )
    return problems


def _check_paths(cfg: RLVRConfig) -> list[str]:
    problems = []
    pretrain = cfg.pretrain
    if not pretrain.startswith("embedded:") and not Path(pretrain).exists():
        problems.append(
            f"pretrain: {pretrain!r} does not exist; point it at a local model directory "
            f"(no model hub is reachable at run time) or use {EMBEDDED_MODEL!r}"
        )
    if not cfg.actor_train.data_args.file_name:
        problems.append(
            "actor_train.data_args.file_name: no training data; list .jsonl / .json / .parquet "
            "files or directories"
        )
    return problems
