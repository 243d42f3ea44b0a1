"""The ``colocation`` section's problems (``COMPONENT_CHECKS["colocation"]``), each naming the
field and the fix: modes and levels, the combinations a sleep mode cannot serve, and on
``device=cuda`` the vLLM memory share the plan (``plan.py``) would refuse at start.

This module imports neither torch nor Ray: validation imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roll_ds.config.ranges import OneOf, field_problems
from roll_ds.config.strategies import STRATEGY_SPECS
from roll_ds.pipeline.colocation.plan import (
    _engine_spec,
    _get,
    colocated_utilization_problems,
    plan_colocation,
)

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig

OFFLOAD_MODES = ("auto", "always", "never")
SLEEP_LEVELS = (1, 2)


def sleeping_backends() -> tuple[str, ...]:
    """The rollout backends with a sleep mode (``StrategySpec.sleeps``)."""
    return tuple(name for name, spec in STRATEGY_SPECS.items() if spec.sleeps)


def colocation_problems(cfg: RLVRConfig) -> list[str]:
    """``colocation``'s problems, each naming the field and the fix (validate.py calls this)."""
    col = cfg.colocation
    rules = {"offload": OneOf(OFFLOAD_MODES), "sleep_level": OneOf(SLEEP_LEVELS)}
    problems = field_problems("colocation", col, rules)
    if col.sleep_level == 2 and cfg.weight_sync.lora_sync == "adapter":
        problems.append(
            "colocation.sleep_level: 2 discards vLLM's base weights, which adapter syncs "
            "(weight_sync.lora_sync=adapter) never resend; use colocation.sleep_level=1 or "
            "weight_sync.lora_sync=merged"
        )
    if col.offload == "always" and cfg.async_generation.max_staleness > 0:
        problems.append(
            "colocation.offload: always offloads the trainer while the engines generate, but "
            f"async_generation.max_staleness={cfg.async_generation.max_staleness} generates "
            "while the trainer trains; use colocation.offload=auto (under async nothing is "
            "offloaded: vLLM keeps its gpu_memory_utilization, the trainer the rest) or "
            "async_generation.max_staleness=0"
        )
    infer, spec = cfg.actor_infer.strategy_args, _engine_spec(cfg)
    if col.offload == "always" and spec is not None and not spec.sleeps:
        problems.append(
            f"colocation.offload: always sleeps the rollout engines, which needs a backend with "
            f"a sleep mode: actor_infer.strategy_args.strategy_name one of "
            f"{', '.join(sleeping_backends())} (got {infer.strategy_name!r}); use "
            "colocation.offload=auto or never"
        )
    switched_off = _get(infer.strategy_config, "enable_sleep_mode") is False
    if col.offload != "never" and spec is not None and spec.gpu_memory_share and switched_off:
        problems.append(
            f"actor_infer.strategy_args.strategy_config.enable_sleep_mode: false, but "
            f"colocation.offload={col.offload} sleeps the engines where they share GPUs with "
            "the trainer; remove enable_sleep_mode or set colocation.offload=never"
        )
    if getattr(cfg, "device", "auto") == "cuda":  # auto: plan_colocation checks on the cluster
        problems += colocated_utilization_problems(cfg, *_sharing(cfg))
    return problems


def _sharing(cfg: RLVRConfig) -> tuple[tuple[str, ...], bool]:
    """On GPUs: the roles that share ``actor_infer``'s devices and whether the choreography
    offloads them while vLLM generates."""
    plan = plan_colocation(cfg, "GPU", check_memory=False)
    return plan.late_start, plan.active
