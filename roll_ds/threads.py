"""The one place that decides how many CPU threads each role's actors compute with.

On a GPU cluster the device does the model's work, but the CPUs beside it still matter:
DeepSpeed's CPU Adam under ZeRO offload runs the whole optimizer step on them (OpenMP threads),
and the data path and vLLM's scheduler run there. Each GPU's placement bundle reserves the CPUs
of ``placement.cpus_per_gpu`` (the node's CPUs per GPU, or the config's ``cpus_per_gpu``), and a
device role's actors compute with them:

- synchronous loop: the roles on a GPU take turns (generation, then log-probs, then training),
  so whichever runs gets all of the bundle's CPUs, e.g. 7 threads per rank on 64-CPU 8-GPU nodes;
- asynchronous loop: generation overlaps training, so each role keeps its share of the bundle.

Without a plan (``plan=None``) GPU roles get ``None``: ``Cluster`` then uses the CPUs the actor
reserved. CPU-only roles (reward workers) get ``None`` on GPUs as well (one thread each).

On CPU machines each device id of a ``device_mapping`` is a CPU slot (a core), and the roles
time-share those slots, so the thread counts follow what runs at once:

- synchronous loop (``async_generation.max_staleness: 0``): the phases run one after another.
  Generation runs alone, so the rollout engine computes with every slot of its node; the
  trainer's ranks (one per slot) compute side by side, one thread each.
- asynchronous loop: generation overlaps training, so every actor keeps one thread per slot it
  holds and the engine and the trainer split the node instead of oversubscribing it.

A role's ``num_threads`` overrides the plan. Measured on the 2-core box: see the README's
step-time table (``benchmarks/versus_trl.py``).

The driver (the pipeline's own process) computes with one thread (``driver_threads``) while the
pipeline runs: its tensors are a step's batch and metrics (thousands of elements), where an
OpenMP team only adds a fork and join per op, and the cores are the actors'. Measured on the
loaded 2-core box: ``torch.expm1`` of a ``[128, 39]`` tensor took 9 ms with the default two
threads and 7 us with one. Elementwise ops give the same bits at any thread count; PyTorch
splits a reduction over threads only past 32768 elements (none in the default run's driver).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roll_ds.config.role_placement import placement, role_configs
from roll_ds.config.schema import RLVRConfig

if TYPE_CHECKING:
    from roll_ds.distributed.placement import PlacementPlan

ROLLOUT_ROLE = "actor_infer"
DRIVER_THREADS = 1  # the pipeline process's torch threads (module doc)


def driver_threads(num_threads: int = DRIVER_THREADS) -> int:
    """Set the calling process's torch threads to ``num_threads``; returns the count before
    (to restore when the pipeline shuts down)."""
    import torch

    before = torch.get_num_threads()
    if before != num_threads:
        torch.set_num_threads(num_threads)
    return before


def role_threads(
    cfg: RLVRConfig, *, on_cuda: bool, plan: PlacementPlan | None = None
) -> dict[str, int | None]:
    """Threads per actor for every configured role (``None``: ``Cluster``'s default).

    ``plan``: the placement the actors start in; on GPUs it says the CPUs each bundle holds."""
    threads: dict[str, int | None] = {}
    for name, role in role_configs(cfg):
        if role.num_threads is not None:
            threads[name] = role.num_threads
        elif on_cuda:
            threads[name] = _gpu_threads(cfg, name, plan) if plan is not None else None
        elif name == ROLLOUT_ROLE and cfg.async_generation.max_staleness == 0:
            threads[name] = _node_slots(cfg, name)
        else:
            threads[name] = 1
    return threads


def _gpu_threads(cfg: RLVRConfig, name: str, plan: PlacementPlan) -> int | None:
    """A device role's threads from its bundle's CPUs (see the module doc)."""
    slots = plan.slots.get(name)
    if not slots or slots[0].node is None:
        return None
    bundle_cpus = plan.bundle_resources().get("CPU", 0.0)
    if cfg.async_generation.max_staleness > 0:
        bundle_cpus *= slots[0].device_share
    return max(1, int(bundle_cpus + 1e-6))


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
