"""Which of the run's roles are replaced in place when a rank dies or hangs, and how a new rank
is brought up (``roll_ds/distributed/recovery.py`` does the replacing, inside every call).

Replaced (``fault_tolerance.max_restarts`` each over the run): the reward roles (``rewards.*``:
rule functions, reward models, judges; ``initialize`` rebuilds their scorer), the reference
(its weights are the pretrained ones: ``initialize`` loads them again) and, in the synchronous
loop, the rollout engines (``actor_infer``: ``initialize``, then a full weight sync into every
engine with the parity check, ``PolicySync.restore_engines``).

Not replaced, and why:
- actor_train and critic: their optimizer state and ZeRO shards are the run (resume from a
  checkpoint: ``resume_from_checkpoint``).
- roles the colocation choreography manages (they take turns on GPUs with the trainers; a new
  rank would have to join that dance in the middle of a phase).
- a role of several DeepSpeed ranks (a reference or reward model on ``deepspeed_*``): its ranks
  share a process group at start, which a new rank cannot join alone.
- actor_infer under ``async_generation`` (its calls come from driver threads, and a streamed
  request lives in the engine that died).
Environment hosts (``roll_ds/agentic/env_pool.py``) replace themselves: a dead host's episodes
end with an error reward and a new host takes its place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from roll_ds.config.fault_tolerance import is_stateless
from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.recovery import CallBounds, Recovery
from roll_ds.pipeline.colocation.choreography import Choreography


def call_bounds(cfg: RLVRConfig) -> CallBounds:
    ft = cfg.fault_tolerance
    return CallBounds(base_s=ft.call_timeout_s, per_token_s=ft.per_token_s)


def watch_stateless(
    cfg: RLVRConfig,
    clusters: Mapping[str, Any],
    colocation: Choreography,
    policy_sync: Any,
) -> Recovery:
    """A ``Recovery`` watching every role this run can replace (module doc)."""
    recovery = Recovery(cfg.fault_tolerance.max_restarts)
    plan = colocation.plan
    managed = {*plan.engines, *plan.trainers, *plan.late_start}
    for name, cluster in clusters.items():
        if not is_stateless(name) or name in managed or _in_a_group(cfg, name, cluster):
            continue
        if name == "actor_infer":
            if cfg.async_generation.max_staleness > 0:
                continue
            recovery.watch(cluster, restore=policy_sync.restore_engines)
        else:
            recovery.watch(cluster)
    return recovery


def _in_a_group(cfg: RLVRConfig, name: str, cluster: Any) -> bool:
    """Whether the role's ranks form a DeepSpeed process group at start (a new rank could not
    rejoin it)."""
    role = cfg.rewards.get(name.removeprefix("rewards.")) if "." in name else getattr(cfg, name)
    strategy = getattr(getattr(role, "strategy_args", None), "strategy_name", None) or ""
    return cluster.world_size > 1 and strategy.startswith("deepspeed")
