"""Ray start-up costs on this machine: ray.init, placement groups, actor start, call latency.

    python benchmarks/ray_startup.py                       # local Ray, 2 CPU slots + 1 CPU worker
    python benchmarks/ray_startup.py --workers 4 --import-torch
    python benchmarks/ray_startup.py --simulated-nodes 2 --workers 4   # 2 raylets x 2 fake GPUs

Prints a table and writes JSON (default output/benchmarks/ray_startup.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray import cloudpickle  # noqa: E402

from roll_ds.distributed.cluster import Cluster  # noqa: E402
from roll_ds.distributed.placement import RoleSpec  # noqa: E402
from roll_ds.distributed.ray_init import connect  # noqa: E402
from roll_ds.distributed.resource_manager import ResourceManager  # noqa: E402
from roll_ds.distributed.worker import Worker  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Bare(Worker):
    def ping(self) -> int:
        return self.rank


class WithTorch(Bare):
    def __init__(self) -> None:
        import torch  # what every real trainer / rollout worker pays

        super().__init__()
        self._t = torch.zeros(1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workers", type=int, default=2, help="device workers (one CPU slot / GPU each)"
    )
    ap.add_argument("--cpu-workers", type=int, default=1, help="CPU-only workers (reward role)")
    ap.add_argument("--import-torch", action="store_true", help="workers import torch in __init__")
    ap.add_argument(
        "--simulated-nodes", type=int, default=0, help="use ray.cluster_utils with N nodes"
    )
    ap.add_argument("--calls", type=int, default=20, help="ping round trips to time")
    ap.add_argument("--out", default=str(ROOT / "output" / "benchmarks" / "ray_startup.json"))
    args = ap.parse_args()

    result: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "ray": ray.__version__,
            "load_avg_1m": os.getloadavg()[0],
        },
        "params": vars(args),
    }
    sim = None
    if args.simulated_nodes:
        from ray.cluster_utils import Cluster as RayTestCluster

        per_node = max(1, -(-args.workers // args.simulated_nodes))
        start = time.perf_counter()
        sim = RayTestCluster(
            initialize_head=True,
            head_node_args={"num_cpus": 4, "num_gpus": per_node, "include_dashboard": False},
        )
        for _ in range(args.simulated_nodes - 1):
            sim.add_node(num_cpus=4, num_gpus=per_node)
        ray.init(address=sim.address, log_to_driver=False)
        sim.wait_for_nodes()
        result["ray_start_s"] = time.perf_counter() - start
        resource, gpn = "GPU", per_node
    else:
        conn = connect(address=None, num_cpus=max(4, args.workers + 2), log_to_driver=False)
        result["ray_start_s"] = conn.init_s
        resource, gpn = "CPU", args.workers

    rm = ResourceManager(
        {
            "devices": RoleSpec(tuple(range(args.workers)), args.workers),
            "cpu": RoleSpec((), args.cpu_workers, 0),
        },
        num_gpus_per_node=gpn,
        device_resource=resource,
        cpus_per_device=0.5,
    )
    start = time.perf_counter()
    rm.reserve()
    result["placement_groups_s"] = time.perf_counter() - start

    cls = WithTorch if args.import_torch else Bare
    roles = {}
    for role in ("devices", "cpu"):
        if role == "cpu" and not args.cpu_workers:
            continue
        cluster = Cluster(role, cls, rm)
        roles[role] = cluster
        result[f"actor_start_s[{role}]"] = cluster.start_s
        result[f"actor_start_per_actor_s[{role}]"] = cluster.start_s / cluster.world_size
    lat = []
    for _ in range(args.calls):
        start = time.perf_counter()
        roles["devices"].ping()
        lat.append(time.perf_counter() - start)
    result["call_all_ranks_ms"] = {"median": 1e3 * statistics.median(lat), "max": 1e3 * max(lat)}

    for cluster in roles.values():
        cluster.shutdown()
    rm.release()
    ray.shutdown()
    if sim is not None:
        sim.shutdown()

    width = max(len(k) for k in result)
    for key, value in result.items():
        if isinstance(value, float):
            print(f"{key:<{width}}  {value:8.3f}")
        else:
            print(f"{key:<{width}}  {value}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    out.write_text(json.dumps(with_host(result), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
