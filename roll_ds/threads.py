"""The one place that decides how many CPU threads each role's actors compute with.

On a GPU cluster the device does the work: an actor gets the CPUs its placement reserved
(``None`` here leaves that to ``Cluster``), which is what DeepSpeed's CPU optimizer under offload
and the data path use. On CPU machines each device id of a ``device_mapping`` is a CPU slot (a
core), and the roles time-share those slots, so the thread counts follow what runs at once:

- synchronous loop (``async_generation.max_staleness: 0``): the phases run one after another.
  Generation runs alone, so the rollout engine computes with every slot of its node; the
  trainer's ranks (one per slot) compute side by side, one thread each.
- asynchronous loop: generation overlaps training, so every actor keeps one thread per slot it
  holds and the engine and the trainer split the node instead of oversubscribing it.

A role's ``num_threads`` overrides the plan. Measured on the 2-core box: see the README's
step-time table (``benchmarks/versus_trl.py``).
"""

from __future__ import annotations

from roll_ds.config.schema import RLVRConfig
from roll_ds.config.validate import placement, role_configs

ROLLOUT_ROLE = "actor_infer"


def role_threads(cfg: RLVRConfig, *, on_cuda: bool) -> dict[str, int | None]:
    """Threads per actor for every configured role (``None``: ``Cluster``'s default)."""
    plan: dict[str, int | None] = {}
    for name, role in role_configs(cfg):
        if role.num_threads is not None:
            plan[name] = role.num_threads
        elif on_cuda:
            plan[name] = None
        elif name == ROLLOUT_ROLE and cfg.async_generation.max_staleness == 0:
            plan[name] = _node_slots(cfg, name)
        else:
            plan[name] = 1
    return plan


def _node_slots(cfg: RLVRConfig, name: str) -> int:
    """CPU slots of the node the role's first worker sits on that any device role uses."""
    where = placement(name, getattr(cfg, name))
    if not where.devices:
        return 1
    per_node = cfg.num_gpus_per_node
    node = where.devices[0] // per_node
    used = set()
    for other, role in role_configs(cfg):
        if other.startswith("rewards."):
            continue
        used |= {d for d in placement(other, role).devices if d // per_node == node}
    return max(1, len(used))
