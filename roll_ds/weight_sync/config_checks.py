"""The ``weight_sync`` section's checks, collected by ``roll_ds.config.validate``: the transport
name, and what ``lora_sync: adapter`` needs of both ends. (The transport against the roles'
shared GPUs is ``select.layout_problems``.) Light: no torch or Ray import."""

from __future__ import annotations

from roll_ds.config.schema import RLVRConfig
from roll_ds.config.strategies import can, names_with


def weight_sync_problems(cfg: RLVRConfig) -> list[str]:
    from roll_ds.weight_sync import check_transport_name

    problems = []
    try:
        check_transport_name(cfg.weight_sync.transport)
    except ValueError as exc:
        problems.append(str(exc).replace("unknown weight_sync.transport", "weight_sync.transport:"))
    return problems + lora_sync_problems(cfg)


def lora_sync_problems(cfg: RLVRConfig) -> list[str]:
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
    if not can(infer.strategy_args.strategy_name, "serves_adapters"):
        problems.append(
            f"weight_sync.lora_sync: adapter needs a rollout backend that serves LoRA adapters "
            f"(actor_infer.strategy_args.strategy_name one of {names_with('serves_adapters')}, "
            f"got {infer.strategy_args.strategy_name!r}); use lora_sync=merged"
        )
    bases = (train.model_args.model_name_or_path, infer.model_args.model_name_or_path)
    if bases[0] != bases[1]:
        problems.append(
            "weight_sync.lora_sync: adapter ships only the adapter, so actor_infer must load the "
            f"trainer's base model: actor_train.model_args.model_name_or_path is {bases[0]!r}, "
            f"actor_infer's {bases[1]!r}; make them equal (or null for pretrain)"
        )
    return problems
