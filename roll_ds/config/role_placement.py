"""Where each role's actors go, read from its config: device ids, world size, devices per worker.

Pure (no Ray, no torch): config validation reports what ``placement`` raises, and the resource
manager, the thread plan and the pipeline's passes read the same answer at run time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from roll_ds.config.device_mapping import DeviceMappingError, parse_device_mapping
from roll_ds.config.estimators import needs_critic
from roll_ds.config.roles import DEVICE_ROLES
from roll_ds.config.schema import RLVRConfig, WorkerConfig


@dataclass(frozen=True)
class RolePlacement:
    """Where a role's actors go, derived from its config."""

    devices: list[int]
    world_size: int
    devices_per_worker: int


def role_configs(cfg: RLVRConfig) -> Iterator[tuple[str, WorkerConfig]]:
    """``(dotted name, config)`` for every role that is configured and used (a critic only with
    an estimator that reads critic values)."""
    for name in DEVICE_ROLES:
        role = getattr(cfg, name)
        if name == "critic" and not needs_critic(cfg.algorithm.adv_estimator):
            continue
        if role is not None:
            yield name, role
    for domain, reward in cfg.rewards.items():
        yield f"rewards.{domain}", reward


def placement(name: str, role: WorkerConfig) -> RolePlacement:
    """Parse a role's devices and world size (raises ValueError naming the field)."""
    try:
        devices = parse_device_mapping(role.device_mapping)
    except DeviceMappingError as exc:
        raise ValueError(f"{name}.device_mapping: {exc}") from None
    per_worker = role.num_gpus_per_worker
    if per_worker < 1:
        raise ValueError(f"{name}.num_gpus_per_worker: must be >= 1, got {per_worker}")
    if not devices:
        if role.world_size is None or role.world_size < 1:
            raise ValueError(f"{name}.world_size: a role without devices needs world_size >= 1")
        return RolePlacement([], role.world_size, 0)
    if len(devices) % per_worker:
        raise ValueError(
            f"{name}.device_mapping: {len(devices)} devices do not split into workers of "
            f"num_gpus_per_worker={per_worker}; use a multiple of {per_worker} devices"
        )
    world_size = len(devices) // per_worker
    if role.world_size is not None and role.world_size != world_size:
        raise ValueError(
            f"{name}.world_size: {role.world_size} disagrees with device_mapping ({len(devices)} "
            f"devices / num_gpus_per_worker {per_worker} = {world_size}); remove world_size or "
            "make them agree"
        )
    return RolePlacement(devices, world_size, per_worker)
