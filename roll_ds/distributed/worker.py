"""Worker: base class of every role's Ray actors.

``Cluster`` gives each rank this environment (read back through the properties below). The
role's ``system_envs`` come through Ray's ``runtime_env``, so they are set before the worker's
module is imported; the per-rank variables are set in the actor process right before
``__init__`` runs (a per-actor runtime_env doubled actor start time on a 2-core box):

    RANK, WORLD_SIZE        the rank within the role and the role's size
    LOCAL_RANK              always 0: each actor sees only its own devices (Ray sets
                            CUDA_VISIBLE_DEVICES per actor), so its first device is index 0 --
                            DeepSpeed and torch pick ``cuda:LOCAL_RANK``
    ROLL_DS_NODE_LOCAL_RANK the rank among the role's workers on the same node
    ROLL_DS_NODE            the logical node index of the device_mapping (absent for CPU roles)
    MASTER_ADDR/PORT        rank 0's node IP and a port that was free there
    ROLL_DS_ROLE            the role name
    OMP_NUM_THREADS, MKL_NUM_THREADS, ROLL_DS_NUM_THREADS   thread budget (1 on CPU by default)
    CUDA_VISIBLE_DEVICES    set by Ray from the bundle's GPU; for multi-device workers set by
                            Cluster to all the worker's GPUs (CUDA reads it at first use)

Subclasses call ``super().__init__()`` (it applies the thread budget and silences the
harmless warnings listed in ``roll_ds.log_noise``) and should create process
groups with ``init_process_group`` (dispatched to all ranks) once the cluster is up, not in
``__init__``: a rank that fails to start would leave the others blocked in the rendezvous.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from roll_ds import timeline
from roll_ds.distributed.devices import visible_gpu_uuids
from roll_ds.distributed.dispatch import Dispatch, register
from roll_ds.log_noise import quiet_warnings


class Worker:
    # Ray concurrency groups of the actor ({name: threads}); methods opt in with
    # ray.method(concurrency_group=name). The rest run one at a time, in order.
    CONCURRENCY_GROUPS: dict[str, int] | None = None

    def __init__(self) -> None:
        apply_thread_budget()
        quiet_warnings()
        check_visible_devices(self.role, self.rank)

    # --- identity (from the env Cluster set) ---------------------------------------------------

    @property
    def role(self) -> str:
        return os.environ.get("ROLL_DS_ROLE", "worker")

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def node_local_rank(self) -> int:
        return int(os.environ.get("ROLL_DS_NODE_LOCAL_RANK", "0"))

    @property
    def master_addr(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    def master_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    # --- helpers every role has ----------------------------------------------------------------

    def _roll_info(self) -> dict[str, Any]:
        """Where this actor runs and what it sees (Cluster collects it at start)."""
        import ray

        ctx = ray.get_runtime_context()
        accelerators = {k: v for k, v in ctx.get_accelerator_ids().items() if v}
        return {
            "rank": self.rank,
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "accelerator_ids": accelerators,
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            # the physical GPUs, in device-index order: Ray ids are per node and renumbered
            "gpu_uuids": visible_gpu_uuids() if accelerators.get("GPU") else (),
            "num_threads": _torch_threads(),
            # start-up profile (roll_ds/timeline.py): boot and __init__ so far
            "timeline": timeline.drain(),
            "libraries": timeline.loaded_libraries(),
        }

    @register(Dispatch.ALL)
    def init_process_group(self, backend: str | None = None, timeout_s: float = 1800.0) -> None:
        """Create the role's default process group from RANK/WORLD_SIZE/MASTER_* (idempotent)."""
        import torch.distributed as dist

        if dist.is_initialized():
            return
        if backend is None:
            from roll_ds.platform import current_platform

            backend = current_platform().dist_backend
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    @register(Dispatch.ALL)
    def close(self) -> None:
        """Free what would outlive this process if it were SIGKILLed (``ray.kill``), before
        ``Cluster`` kills it: here the process groups; subclasses free their strategy or scorer
        first (a vLLM engine's shared-memory queues, its worker processes), then call this."""
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    @register(Dispatch.ALL)
    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(self, *args, **kwargs)`` on the worker (debugging, one-off setup)."""
        return fn(self, *args, **kwargs)


def apply_thread_budget() -> None:
    """Set torch's intra-op threads to ROLL_DS_NUM_THREADS if torch is already imported.

    OMP_NUM_THREADS (set in the actor's env) sizes torch's pool when torch is imported later.
    """
    n = os.environ.get("ROLL_DS_NUM_THREADS")
    if n and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(n))


def check_visible_devices(role: str, rank: int) -> None:
    """In a Ray actor that reserved GPUs: raise unless CUDA sees exactly the GPUs it reserved
    (``CUDA_VISIBLE_DEVICES`` as Ray, or Cluster for a multi-device worker, set it before
    ``__init__``). vLLM spawns its tensor-parallel workers from here with this environment, so a
    worker that saw more GPUs would place them on another rank's devices."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    try:
        reserved = list(ray.get_runtime_context().get_accelerator_ids().get("GPU") or [])
    except RuntimeError:  # not inside an actor or task
        return
    if not reserved:
        return
    import torch

    # A CPU build of torch sees no GPU whatever the environment: a cluster that only advertises
    # GPUs (Ray's simulated multi-node cluster, placement tests) can check the ids, not the count.
    count = torch.cuda.device_count() if torch.version.cuda is not None else None
    problem = visible_device_problem(
        role=role,
        rank=rank,
        reserved=reserved,
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        device_count=count,
    )
    if problem:
        raise RuntimeError(problem)


def visible_device_problem(
    *, role: str, rank: int, reserved: list[str], visible: str | None, device_count: int | None
) -> str | None:
    """Why the GPUs CUDA sees (``device_count``, listed by ``visible``: the
    ``CUDA_VISIBLE_DEVICES`` value) are not exactly those Ray ``reserved`` for this actor (the
    first bundle's id; a multi-device worker's list has more); None when they are.
    ``device_count`` None (a CPU build of torch): only the ids are checked."""
    who = f"{role} rank {rank}"
    if visible is None:
        gpus = "every GPU" if device_count is None else f"all {device_count} GPUs"
        return (
            f"{who}: Ray reserved GPU {', '.join(reserved)} but CUDA_VISIBLE_DEVICES is unset, "
            f"so this actor sees {gpus} of its node (is "
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES set? unset it)"
        )
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    missing = [r for r in reserved if r not in ids]
    if missing:
        return (
            f"{who}: CUDA_VISIBLE_DEVICES={visible} does not list GPU {', '.join(missing)} that "
            "Ray reserved for it (a system_envs or runtime_env entry overriding "
            "CUDA_VISIBLE_DEVICES? remove it)"
        )
    if device_count is not None and device_count != len(ids):
        return (
            f"{who}: reserved {len(ids)} GPU(s) (CUDA_VISIBLE_DEVICES={visible}) but CUDA sees "
            f"{device_count}: CUDA was initialised before the actor's devices were set (do not "
            "touch torch.cuda when a worker module is imported)"
        )
    return None


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def node_probe() -> tuple[str, str, int]:
    """(node id, node IP, a TCP port free on that node) -- run as a Ray task on the target node."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port
