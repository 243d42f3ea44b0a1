"""One role's checks: its strategy, its devices against the cluster, its LoRA targets, its
fields; a reward role's own checks come from ``roll_ds.rewards.config_checks``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from roll_ds.config.checks.components import component_problems
from roll_ds.config.checks.fields import role_field_problems
from roll_ds.config.checks.micro_batches import micro_batch_problems
from roll_ds.config.roles import DEVICE_ROLES, TRAIN_ROLES
from roll_ds.config.schema import (
    ATTN_IMPLEMENTATIONS,
    FLASH_ATTENTION_2,
    FLASH_ATTENTION_DTYPES,
    ModelArgs,
    RewardConfig,
    RLVRConfig,
    WorkerConfig,
)
from roll_ds.config.strategies import STRATEGIES, STRATEGY_SPECS, load_hook

if TYPE_CHECKING:
    from roll_ds.config.role_placement import RolePlacement

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


def role_problems(
    cfg: RLVRConfig, name: str, role: WorkerConfig, where: RolePlacement | None
) -> list[str]:
    """Everything about one role (``where``: its placement, None when that did not parse)."""
    problems = strategy_problems(name, role, where)
    if where is not None:
        problems += device_mapping_problems(cfg, name, where)
    if isinstance(role, RewardConfig):
        problems += component_problems("reward_role", name, role)
    problems += role_field_problems(name, role)
    problems += attention_dtype_problems(name, role.model_args)
    problems += lora_target_problems(name, role.model_args)
    problems += micro_batch_problems(cfg, name, role)
    return problems


def strategy_problems(name: str, role: WorkerConfig, where: RolePlacement | None) -> list[str]:
    """The role's ``strategy_name`` exists and can do the role's job; then the backend's own
    checks of its ``strategy_args`` (``StrategySpec.role_checks``)."""
    strategy = role.strategy_args.strategy_name
    field = f"{name}.strategy_args.strategy_name"
    if strategy is None:
        if name in DEVICE_ROLES:
            return [f"{field}: required; valid: " + ", ".join(STRATEGIES.names())]
        return []
    if strategy not in STRATEGIES:
        return [f"{field}: {STRATEGIES.unknown_message(strategy)}"]
    problems = _capability_problems(name, field, strategy)
    spec = STRATEGY_SPECS[strategy]
    if spec.role_checks is not None:
        problems += load_hook(spec.role_checks)(name, role, where)
    return problems


def _capability_problems(name: str, field: str, strategy: str) -> list[str]:
    spec = STRATEGY_SPECS[strategy]
    problems = []
    if name in TRAIN_ROLES and not spec.trains:
        trainers = [n for n, s in STRATEGY_SPECS.items() if s.trains]
        problems.append(f"{field}: {strategy!r} cannot train; use one of {', '.join(trainers)}")
    if name == "actor_infer" and not spec.generates:
        generators = [n for n, s in STRATEGY_SPECS.items() if s.generates]
        problems.append(
            f"{field}: {strategy!r} cannot generate rollouts; use one of {', '.join(generators)}"
        )
    return problems


def device_mapping_problems(cfg: RLVRConfig, name: str, where: RolePlacement) -> list[str]:
    """A device role has devices, inside the cluster, each worker's devices on one node."""
    if name in DEVICE_ROLES and not where.devices:
        return [
            f"{name}.device_mapping: the role has no devices; give it some, e.g. "
            "device_mapping: list(range(0,2))"
        ]
    per_node = cfg.num_gpus_per_node
    if per_node < 1 or cfg.num_nodes < 1:
        return []  # reported by the pipeline's field ranges
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


def attention_dtype_problems(name: str, model: ModelArgs) -> list[str]:
    """flash-attn (fa2) in a dtype it has no kernels for: transformers only warns when it loads
    the model, and the first forward fails, after every actor has started."""
    attn = model.attn_implementation
    if ATTN_IMPLEMENTATIONS.get(attn) != FLASH_ATTENTION_2 or model.dtype in FLASH_ATTENTION_DTYPES:
        return []
    return [
        f"{name}.model_args.dtype: {model.dtype} with attn_implementation {attn}: flash-attn has "
        f"no {model.dtype} kernels and the first forward would fail; set "
        f"{name}.model_args.dtype: bf16 (or fp16), or another "
        f"{name}.model_args.attn_implementation (sdpa, eager, or null)"
    ]


def lora_target_problems(name: str, model: ModelArgs) -> list[str]:
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
