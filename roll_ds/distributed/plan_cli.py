"""``python -m roll_ds.distributed.plan_cli CONFIG [key=value ...]``: print a config's placement
plan without Ray (``placement.format_plan``; ``cluster/README.md`` shows an example)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from roll_ds.config import load_config
from roll_ds.distributed.placement import format_plan, plan_placement
from roll_ds.distributed.resource_manager import role_specs_from_config

USAGE = "usage: python -m roll_ds.distributed.plan_cli CONFIG [key=value ...]"


def main(argv: Sequence[str] | None = None) -> None:
    """Compose ``CONFIG`` with the overrides and print its plan: one line per node, one per role."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit(USAGE)
    cfg = load_config(args[0], args[1:], check_files=False)
    plan = plan_placement(
        role_specs_from_config(cfg),
        num_gpus_per_node=cfg.num_gpus_per_node,
        num_nodes=cfg.num_nodes,
        device_resource="CPU" if cfg.device == "cpu" else "GPU",
        cpus_per_device=cfg.cpus_per_gpu or 1.0,
    )
    view = "CPU slots" if cfg.device == "cpu" else "GPU view"
    print(f"num_gpus_per_node {cfg.num_gpus_per_node}, num_nodes {cfg.num_nodes} ({view})")
    if cfg.device != "cpu" and cfg.cpus_per_gpu is None:
        print("CPUs per GPU bundle: shown as 1; on the cluster cpus_per_gpu(nodes) decides")
    print(format_plan(plan))


if __name__ == "__main__":
    main()
