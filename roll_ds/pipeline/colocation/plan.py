"""Who the colocation choreography manages, decided once from the config and the placement
(pure), and what stays on a GPU the engines share while they generate.

``colocation.offload``: ``auto`` manages roles that share a GPU with an engine (on CPU machines
nothing is shared: device ids are CPU slots in one host memory, so nothing happens and roles
start at once, as before); ``always`` manages every model role whatever the placement (on CPU
the calls are no-ops that still track state: tests check the order there); ``never`` manages
nothing (engines still start before the trainers that share their GPUs: a static split where
vLLM keeps ``gpu_memory_utilization`` and the trainer gets the rest). Under
``async_generation`` generation overlaps training, so ``auto`` offloads nothing (the static
split) and ``always`` is refused.

On GPUs shared with vLLM, what stays resident beside it (``resident_beside_engines``) comes out
of its ``gpu_memory_utilization``: ``plan_colocation`` refuses to start with it unset, and
validation (``checks.py``) refuses the same on ``device=cuda``.

This module imports neither torch nor Ray: validation imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roll_ds.config.device_mapping import DeviceMappingError, parse_device_mapping
from roll_ds.config.estimators import needs_critic
from roll_ds.config.strategies import STRATEGY_SPECS, StrategySpec

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig

MODEL_ROLES = ("actor_train", "actor_infer", "reference", "critic")


def _engine_spec(cfg: RLVRConfig) -> StrategySpec | None:
    """``actor_infer``'s backend (None for an unknown name, which validation reports)."""
    return STRATEGY_SPECS.get(cfg.actor_infer.strategy_args.strategy_name)


# --- the plan: who is managed (pure) -------------------------------------------------------


@dataclass(frozen=True)
class ColocationPlan:
    """Which roles the choreography manages, decided once from the config and placement."""

    engines: tuple[str, ...] = ()  # slept while the trainers compute
    trainers: tuple[str, ...] = ()  # offloaded while the engines generate
    late_start: tuple[str, ...] = ()  # start after the engines (they share the engines' GPUs)
    sleep_level: int = 1
    notes: tuple[str, ...] = ()  # what was decided and why (logged at start)

    @property
    def active(self) -> bool:
        return bool(self.engines)

    def start_stages(self, roles: Iterable[str]) -> list[list[str]]:
        """The roles in start order: everything else (with the engines) first, then the roles
        that share the engines' GPUs. One stage (all at once) when nothing is shared."""
        roles = list(roles)
        early = [r for r in roles if r not in self.late_start]
        late = [r for r in roles if r in self.late_start]
        return [stage for stage in (early, late) if stage]


def plan_colocation(
    cfg: RLVRConfig, device_resource: str, *, check_memory: bool = True
) -> ColocationPlan:
    """The plan for ``cfg`` on devices of Ray resource ``device_resource`` ("GPU" or "CPU").
    On GPUs shared with the engines, ``check_memory`` refuses an unset
    ``gpu_memory_utilization`` (``colocated_utilization_problems``)."""
    plan = _plan(cfg, device_resource)
    if check_memory and device_resource == "GPU":
        problems = colocated_utilization_problems(cfg, plan.late_start, plan.active)
        if problems:
            raise ValueError(problems[0])
    return plan


def _plan(cfg: RLVRConfig, device_resource: str) -> ColocationPlan:
    col = cfg.colocation
    roles = {name: getattr(cfg, name) for name in MODEL_ROLES if getattr(cfg, name) is not None}
    if "critic" in roles and not needs_critic(cfg.algorithm.adv_estimator):
        del roles["critic"]
    spec = _engine_spec(cfg)
    if spec is None or not spec.sleeps:
        return ColocationPlan(sleep_level=col.sleep_level)  # no sleep mode to manage
    engines = ["actor_infer"]
    others = [n for n in roles if n not in engines]
    if col.offload == "always":
        late = tuple(others)
    elif device_resource == "GPU":
        engine_devices = set().union(*(_devices(roles[e]) for e in engines))
        late = tuple(n for n in others if _devices(roles[n]) & engine_devices)
    else:  # CPU slots are one host memory: nothing to free, nothing to order
        late = ()
    if not late:
        return ColocationPlan(sleep_level=col.sleep_level)
    shared = f"{', '.join(late)} share{'s' if len(late) == 1 else ''} devices with {engines[0]}"
    if col.offload == "never" or cfg.async_generation.max_staleness > 0:
        why = (
            "colocation.offload=never"
            if col.offload == "never"
            else f"async_generation.max_staleness={cfg.async_generation.max_staleness} "
            "overlaps generation with training"
        )
        note = (
            f"{shared}: nothing is offloaded ({why}); {engines[0]} starts first and keeps its "
            "gpu_memory_utilization for the whole run, the trainers must fit in the rest"
        )
        return ColocationPlan(late_start=late, sleep_level=col.sleep_level, notes=(note,))
    note = (
        f"{shared}: {engines[0]} starts first, sleeps (level {col.sleep_level}) while they "
        "compute; they are offloaded while it generates"
    )
    return ColocationPlan(
        engines=tuple(engines),
        trainers=late,
        late_start=late,
        sleep_level=col.sleep_level,
        notes=(note,),
    )


def _devices(role: Any) -> set[int]:
    try:
        return set(parse_device_mapping(role.device_mapping))
    except DeviceMappingError:  # validation reports it
        return set()


# --- what stays resident beside the engines ------------------------------------------------


# vLLM's default gpu_memory_utilization: the share of the *whole* GPU it may take, sized as if
# the GPU were empty. What a colocated trainer keeps resident must come out of it.
VLLM_DEFAULT_UTILIZATION = 0.9
# A starting point per item that stays on a shared GPU while vLLM generates (a CUDA context
# with NCCL and allocator caches is 0.5-2 GB; states of a small model more): the refusal's
# suggestion, not a measurement.
RESIDENT_SHARE = 0.1
UTILIZATION_FLOOR = 0.3


def resident_beside_engines(cfg: RLVRConfig, late: Sequence[str], offloads: bool) -> list[str]:
    """What stays on the GPUs ``actor_infer`` shares with the roles ``late`` while vLLM
    generates (``offloads``: the choreography offloads the trainers meanwhile)."""
    resident = [f"the CUDA context and allocator cache of {', '.join(late)}"]
    if not offloads:
        return [*resident, f"every state of {', '.join(late)} (nothing is offloaded)"]
    if "actor_train" in late:
        ds = cfg.actor_train.strategy_args.strategy_config or {}
        stage, offloaded = _zero_stage(ds), _offloaded(ds)
        if stage == 0:
            resident.append(
                "actor_train's weights, gradients and Adam states (ZeRO-0 cannot offload)"
            )
        elif stage == 3 and not offloaded and not _fused_adam(ds):
            resident.append(
                "actor_train's fp32 master weights and Adam states (ZeRO-3 offloads them only "
                "for DeepSpeed's FusedAdam: an optimizer section of type Adam/AdamW)"
            )
    if "reference" in late:
        resident.append("the reference model while it is reloaded for log-probs")
    return resident


def colocated_utilization_problems(
    cfg: RLVRConfig, late: Sequence[str], offloads: bool
) -> list[str]:
    """A refusal when ``actor_infer`` shares GPUs with ``late`` and leaves vLLM's
    ``gpu_memory_utilization`` at its empty-GPU default: it names what stays resident and a
    value to start from. Backends that take no share of the GPU at start (hf_infer: a model and
    what each call allocates) have nothing to size."""
    infer, spec = cfg.actor_infer.strategy_args, _engine_spec(cfg)
    if spec is None or not spec.gpu_memory_share:
        return []
    if not late or _get(infer.strategy_config, "gpu_memory_utilization") is not None:
        return []
    resident = resident_beside_engines(cfg, late, offloads)
    suggested = max(UTILIZATION_FLOOR, VLLM_DEFAULT_UTILIZATION - RESIDENT_SHARE * len(resident))
    return [
        f"actor_infer.strategy_args.strategy_config.gpu_memory_utilization is unset while "
        f"actor_infer shares GPUs with {', '.join(late)}: vLLM's default "
        f"{VLLM_DEFAULT_UTILIZATION} is sized on an empty GPU, but beside it stay "
        f"{'; '.join(resident)}. Set +actor_infer.strategy_args.strategy_config."
        f"gpu_memory_utilization={suggested:.2f} (a starting point: lower it if vLLM reports too "
        "little free memory at start, raise it for a larger KV cache)"
    ]


def _zero_stage(ds: Any) -> int:
    try:
        return int((_get(ds, "zero_optimization") or {}).get("stage", 0))
    except (AttributeError, TypeError, ValueError):
        return 0


def _offloaded(ds: Any) -> bool:
    zero = _get(ds, "zero_optimization") or {}
    return any(
        (_get(zero, key) or {}).get("device", "none") not in (None, "none")
        for key in ("offload_optimizer", "offload_param")
    )


def _fused_adam(ds: Any) -> bool:
    """DeepSpeed builds FusedAdam on GPUs for an optimizer section of type Adam/AdamW (unless
    ``torch_adam``); without a section roll_ds passes torch's AdamW."""
    opt = _get(ds, "optimizer") or {}
    params = _get(opt, "params") or {}
    kind = str(_get(opt, "type") or "").lower()
    return kind in ("adam", "adamw") and not _get(params, "torch_adam")


def _get(mapping: Any, key: str) -> Any:
    try:
        return mapping.get(key) if mapping is not None else None
    except AttributeError:
        return None
