"""The checks that depend on the device a run uses, for ``device: auto`` too.

A check that reads ``cfg.device`` (ZeRO++ needs CUDA, vLLM's seeded chunked prefill fails on CPU,
the weight-sync transport against the GPUs the roles share, ``cuda_ipc`` needs CUDA) sees
``auto`` as neither. What ``auto`` means is decided in one place, ``roll_ds.platform``:
``planned_device`` answers before Ray is connected for a local Ray (this machine), so these
checks run here with that answer, before any actor starts, instead of failing once the roles
are up. A run that joins a cluster (``ray.address``, ``RAY_ADDRESS``) learns its device from the
cluster's resources (so does a config of several nodes); ``decide_run_platform`` runs the same
checks then, still before any actor.

Torch is imported only where it must be asked (a GPU driver is installed) and the answer
matters (some check differs between cpu and cuda).
"""

from __future__ import annotations

import dataclasses
import os

from roll_ds.config.checks.components import component_problems
from roll_ds.config.schema import RLVRConfig
from roll_ds.platform import planned_device

DEVICES = ("cpu", "cuda")


def device_checks(cfg: RLVRConfig) -> list[str]:
    """Problems of ``cfg`` on ``cfg.device`` (cpu or cuda) from every device-dependent check."""
    problems = component_problems("deepspeed_device", cfg)
    problems += component_problems("rollout_device", cfg)
    problems += component_problems("weight_sync_layout", cfg)
    problems += transport_device_problems(cfg)
    return problems


def transport_device_problems(cfg: RLVRConfig) -> list[str]:
    """``weight_sync.transport: cuda_ipc`` shares GPU memory: refused on cpu (it would fail at
    the first sync's connect, after every role started)."""
    if cfg.device != "cpu" or cfg.weight_sync.transport != "cuda_ipc":
        return []
    return [
        "weight_sync.transport: cuda_ipc shares the weights through GPU memory, and this run "
        "has no CUDA GPUs (its device is cpu); use auto (object_store on one node, collective "
        "across nodes), collective or object_store"
    ]


def ray_address(cfg: RLVRConfig) -> str | None:
    """The Ray cluster the run joins (``ray.address``, else ``RAY_ADDRESS``, as
    ``roll_ds.distributed.ray_init.connect_from_config`` reads them; a config of several nodes
    names none but cannot be one machine's local Ray); None: a local Ray."""
    if cfg.num_nodes > 1:
        return cfg.ray.address or os.environ.get("RAY_ADDRESS") or f"{cfg.num_nodes} nodes"
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or None


def device_problems_before_start(cfg: RLVRConfig) -> list[str]:
    """``device_checks`` for the device the run will use. Explicit ``cpu``/``cuda``: the checks
    validation runs with ``cfg`` itself see it, so only what no other check covers is added.
    ``auto``: the checks under what it resolves to here, each line saying so; nothing when
    cpu and cuda agree (then no device needs deciding) or when a joined cluster decides."""
    if cfg.device != "auto":
        return transport_device_problems(cfg)
    found = {d: device_checks(dataclasses.replace(cfg, device=d)) for d in DEVICES}
    if not any(found.values()):
        return []
    device = planned_device(cfg.device, ray_address(cfg))
    if device is None:
        return []  # decided from the joined cluster's resources, checked then
    why = "this machine has CUDA GPUs" if device == "cuda" else "this machine has no CUDA GPU"
    note = f" [device: auto is {device} here: {why}, and a local Ray runs on it]"
    return [problem + note for problem in found[device]]
