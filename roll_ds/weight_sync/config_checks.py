"""The ``weight_sync`` section's checks, collected by ``roll_ds.config.validate``: the transport
name, its bound against the trainers' process-group timeout, and what ``lora_sync: adapter``
needs of both ends. (The transport against the roles'
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
    return problems + bound_problems(cfg) + lora_sync_problems(cfg)


# What the other trainer ranks' wait in a gather needs beyond train rank 0's longest wait on an
# engine (one group operation, weight_sync.timeout_s): rank 0's own gather of the bucket and its
# walk back into the gathers after the sync failed (weight_sync/worker.py, follow_gathers).
PROCESS_GROUP_MARGIN_S = 300.0


def bound_problems(cfg: RLVRConfig) -> list[str]:
    """A sync's group operation must time out well before the trainers' process group does:
    under ZeRO-3 the other train ranks wait in the next bucket's gather while rank 0 waits on a
    stuck engine, and torch's watchdog ends a rank past ``process_group_timeout_s``, which turns
    the engine's replacement into a trainer restart."""
    sync_s = cfg.weight_sync.timeout_s
    group_s = cfg.fault_tolerance.process_group_timeout_s
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (sync_s, group_s))
    if not numbers or sync_s <= 0 or group_s <= 0 or sync_s + PROCESS_GROUP_MARGIN_S <= group_s:
        return []
    return [
        f"weight_sync.timeout_s ({sync_s:g}) must be at least {PROCESS_GROUP_MARGIN_S:g} s below "
        f"fault_tolerance.process_group_timeout_s ({group_s:g}): while train rank 0 waits up to "
        "weight_sync.timeout_s on a stuck engine, the other trainer ranks wait for it in a "
        "ZeRO-3 gather and torch ends them at the process-group timeout, so the engine's "
        "replacement would become a trainer restart; raise fault_tolerance.process_group_"
        f"timeout_s to {sync_s + PROCESS_GROUP_MARGIN_S:g} or more, or lower weight_sync."
        f"timeout_s to {max(group_s - PROCESS_GROUP_MARGIN_S, 0):g} or less"
    ]


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
