"""Connect to Ray: start a local one by default, or join a running cluster.

Address order: the ``address`` argument (``ray.address`` in the config), then ``$RAY_ADDRESS``,
else a local Ray is started on this machine. The dashboard is off unless asked for (it costs a
process and a second or two on small boxes). ``connect`` times ``ray.init``.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig


@dataclass(frozen=True)
class RayConnection:
    address: str | None  # None: a local Ray this process started
    started_local: bool
    init_s: float  # seconds ray.init took (0 if Ray was already initialised)
    resources: dict[str, float]

    def summary(self) -> str:
        where = "local Ray" if self.started_local else f"Ray cluster at {self.address}"
        cpus, gpus = self.resources.get("CPU", 0), self.resources.get("GPU", 0)
        return f"{where}: CPU={cpus:g} GPU={gpus:g}, ray.init {self.init_s:.2f} s"


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    include_dashboard: bool = False,
    log_to_driver: bool = True,
    namespace: str = "roll_ds",
    runtime_env: dict[str, Any] | None = None,
) -> RayConnection:
    """``ray.init`` as described in the module doc; returns what it connected to and how long."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        return RayConnection(address, False, 0.0, ray.cluster_resources())
    kwargs: dict[str, Any] = {
        "namespace": namespace,
        "log_to_driver": log_to_driver,
        "runtime_env": runtime_env,
    }
    if address:
        kwargs["address"] = address
    else:
        # An explicit "local" so a RAY_ADDRESS read by ray itself cannot redirect us.
        kwargs.update(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=include_dashboard,
        )
    start = time.perf_counter()
    ray.init(**kwargs)
    init_s = time.perf_counter() - start
    return RayConnection(address, not address, init_s, ray.cluster_resources())


def local_num_cpus(cfg: RLVRConfig) -> int:
    """CPUs a local Ray should declare for ``cfg``: the machine's, or more when the plan needs it.

    On CPU-only machines each device of ``device_mapping`` is a CPU slot reserved in a placement
    group, and reward workers ask a fraction of a CPU beside them; Ray's CPU count is a scheduling
    budget, not a thread count (each actor runs 1 thread, see Cluster), so declaring more CPUs
    than cores is safe and lets e.g. 2 trainer slots + rollout + rewards fit on a 2-core box.
    """
    from roll_ds.distributed.placement import plan_placement
    from roll_ds.distributed.resource_manager import role_specs_from_config
    from roll_ds.platform import decide_platform

    plan = plan_placement(
        role_specs_from_config(cfg),
        num_gpus_per_node=cfg.num_gpus_per_node,
        num_nodes=cfg.num_nodes,
        device_resource=decide_platform(
            cfg.device
        ).ray_device_resource,  # a local Ray: this machine
        cpus_per_device=cfg.cpus_per_gpu or 1.0,
    )
    need = math.ceil(plan.total_cpus()) + 1  # +1: probes and the odd helper task
    return max(os.cpu_count() or 1, need)


def connect_from_config(cfg: RLVRConfig, *, log_to_driver: bool = True) -> RayConnection:
    """``connect`` with ``cfg.ray``; a local Ray gets ``ray.num_cpus`` or ``local_num_cpus``."""
    ray_cfg = cfg.ray
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS") or None
    num_cpus = None if address else (ray_cfg.num_cpus or local_num_cpus(cfg))
    return connect(
        address,
        num_cpus=num_cpus,
        include_dashboard=ray_cfg.include_dashboard,
        log_to_driver=log_to_driver,
        namespace=ray_cfg.namespace,
        runtime_env={"env_vars": dict(cfg.system_envs)} if cfg.system_envs else None,
    )


# Ray's warning when ray.init runs off the main thread: the handler it would set is set here.
_SIGTERM_WARNING = "SIGTERM handler is not set because current thread is not the main thread"


class _DropSigtermWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _SIGTERM_WARNING not in record.getMessage()


def connect_in_background(cfg: RLVRConfig) -> Future[RayConnection]:
    """``connect_from_config`` in a thread: a local ``ray.init`` spends its 4-5 s mostly
    waiting for the processes it starts (GCS, raylet, agents), and the driver meanwhile imports
    the pipeline and loads its tokenizer and tasks (about as long). ``result()`` is the
    connection, or raises what ``connect_from_config`` raised.

    The thread stays alive until ``release_background()``: Ray starts its processes with
    ``PR_SET_PDEATHSIG``, which Linux fires when the *thread* that forked them ends, so a thread
    that returned after ``ray.init`` took the GCS down with it. Call this from the main thread:
    Ray sets its SIGTERM handler (exit) only there, so the same handler is set here, and Ray's
    warning that it did not set it is dropped. The run stops a Ray it started either way
    (``launch.stop_local_ray``), also when bad input ends it before the pipeline starts."""
    import ray._private.worker as ray_worker

    def on_sigterm(signum: int, frame: Any) -> None:
        sys.exit(signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    ray_worker.logger.addFilter(_DropSigtermWarning())
    future: Future[RayConnection] = Future()
    _release.clear()

    def hold() -> None:
        from roll_ds import timeline

        try:
            with timeline.phase("ray.init (in the background)"):
                future.set_result(connect_from_config(cfg))
        except BaseException as exc:
            future.set_exception(exc)
            return
        _release.wait()  # Ray's processes die with this thread (PR_SET_PDEATHSIG)

    threading.Thread(target=hold, name="ray-init", daemon=True).start()
    return future


_release = threading.Event()


def release_background() -> None:
    """Let ``connect_in_background``'s thread end (after ``ray.shutdown``)."""
    _release.set()
