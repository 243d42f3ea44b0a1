"""Reserve Ray placement groups for a ``PlacementPlan`` and hand out per-actor scheduling options.

One placement group per logical node, pinned to its Ray node with a bundle label selector on
``ray.io/node-id`` (so ranks land on the node their device ids name), bundles = the node's used
devices. Before anything is created the plan is checked against ``ray.nodes()`` and
``ray.available_resources()``; ``pg.ready()`` is awaited with a bound. Either way an unsatisfiable
placement raises ``PlacementError`` with the numbers instead of waiting forever.

``from_config`` is where a run's device decision is made: from the config's ``device`` and the
connected cluster's resources, not the driver's own torch (a CPU-only head drives GPU workers).
The decision is installed for the driver (``roll_ds.platform.use_platform``) and handed to every
device rank as ``ROLL_DS_DEVICE``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll_ds.distributed.errors import PlacementError
from roll_ds.distributed.placement import (
    NodeInfo,
    RoleSpec,
    WorkerSlot,
    cpus_per_gpu,
    format_plan,
    match_nodes,
    plan_placement,
)
from roll_ds.platform import BY_DEVICE, DEVICE_ENV, Platform, decide_platform, use_platform

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig

NODE_ID_LABEL = "ray.io/node-id"
VISIBLE_DEVICES_ENV = {"GPU": "CUDA_VISIBLE_DEVICES"}
DEVICE_TYPES = {"GPU": "cuda", "CPU": "cpu"}  # Ray device resource -> ROLL_DS_DEVICE of its ranks


@dataclass(frozen=True)
class ActorPlacement:
    """Everything ``Cluster`` needs to start one rank: where, what it asks for, extra env."""

    slot: WorkerSlot
    node_id: str | None  # Ray node id; None: CPU-only actor, anywhere
    node_ip: str | None
    options: dict[str, Any]  # for ActorClass.options(...)
    env: dict[str, str]  # set in the actor before Worker.__init__ (multi-device workers' devices)
    # set there too where the actor's environment has no value yet (the role's system_envs win):
    # the platform's process_env (NCCL's dump-and-abort off on GPUs)
    env_defaults: dict[str, str] = field(default_factory=dict)


def role_specs_from_config(cfg: RLVRConfig) -> dict[str, RoleSpec]:
    """Flatten every configured role of ``cfg`` into a ``RoleSpec``."""
    from roll_ds.config.role_placement import placement, role_configs

    specs = {}
    for name, role in role_configs(cfg):
        where = placement(name, role)
        specs[name] = RoleSpec(tuple(where.devices), where.world_size, where.devices_per_worker)
    return specs


def decide_run_platform(cfg: RLVRConfig) -> Platform:
    """The run's platform from ``cfg.device`` and the connected Ray cluster's resources,
    installed as the driver's ``current_platform()`` (the transport choice reads it there)."""
    platform = decide_platform(cfg.device, ray.cluster_resources())
    use_platform(platform)
    if cfg.device == "auto":
        check_resolved_device(cfg, platform.device_type)
    return platform


def check_resolved_device(cfg: RLVRConfig, device: str) -> None:
    """``device: auto`` resolved to ``device``: the checks validation applies to an explicit
    device (``roll_ds/config/checks/device.py``: ZeRO++ on cpu, the weight-sync transport
    against shared GPUs, ``cuda_ipc`` on cpu, vLLM's seeded chunking on cpu), now, before any
    actor starts. Validation ran them already for a local Ray; a joined cluster's device is
    only known here."""
    import dataclasses

    from roll_ds.config.checks.device import device_checks
    from roll_ds.config.validate import ConfigError

    problems = device_checks(dataclasses.replace(cfg, device=device))
    if problems:
        raise ConfigError(problems)


class ResourceManager:
    """Plans from plain parameters, reserves with ``reserve()``, hands out ``placements(role)``."""

    def __init__(
        self,
        roles: Mapping[str, RoleSpec],
        *,
        num_gpus_per_node: int,
        num_nodes: int | None = None,
        device_resource: str | None = None,
        cpus_per_device: float = 1.0,
        cpus_per_cpu_worker: float = 0.1,
        ready_timeout_s: float = 60.0,
        visible_devices_env: str | None = None,
    ) -> None:
        if device_resource is None:
            from roll_ds.platform import current_platform

            platform = current_platform()
            device_resource = platform.ray_device_resource
            visible_devices_env = visible_devices_env or platform.visible_devices_env
        self.visible_devices_env = visible_devices_env or VISIBLE_DEVICES_ENV.get(device_resource)
        self.platform: Platform | None = BY_DEVICE.get(DEVICE_TYPES.get(device_resource, ""))
        self.plan = plan_placement(
            roles,
            num_gpus_per_node=num_gpus_per_node,
            num_nodes=num_nodes,
            device_resource=device_resource,
            cpus_per_device=cpus_per_device,
            cpus_per_cpu_worker=cpus_per_cpu_worker,
        )
        self.ready_timeout_s = ready_timeout_s
        self.nodes: dict[int, NodeInfo] = {}
        self.placement_groups: dict[int, PlacementGroup] = {}
        self.bundle_device_ids: dict[int, list[str]] = {}  # node -> Ray's device id per bundle
        self.reserve_s: float | None = None

    @classmethod
    def from_config(
        cls, cfg: RLVRConfig, *, roles: Collection[str] | None = None, **kwargs: Any
    ) -> ResourceManager:
        """For ``cfg`` on the connected Ray cluster: decides the platform
        (``decide_run_platform``) and, on GPUs, the CPUs per GPU bundle (``cfg.cpus_per_gpu``,
        or ``placement.cpus_per_gpu`` of the cluster's GPU nodes). ``roles``: plan only these
        (e.g. evaluation's rollout and reward roles); None: every configured role."""
        platform = decide_run_platform(cfg)
        kwargs.setdefault("device_resource", platform.ray_device_resource)
        kwargs.setdefault("visible_devices_env", platform.visible_devices_env)
        if platform.is_cuda and "cpus_per_device" not in kwargs:
            nodes = [NodeInfo.from_ray(n) for n in ray.nodes()]
            kwargs["cpus_per_device"] = cfg.cpus_per_gpu or cpus_per_gpu(
                nodes, cfg.num_gpus_per_node, cfg.num_nodes
            )
        specs = role_specs_from_config(cfg)
        if roles is not None:
            specs = {name: spec for name, spec in specs.items() if name in roles}
        return cls(
            specs,
            num_gpus_per_node=cfg.num_gpus_per_node,
            num_nodes=cfg.num_nodes,
            **kwargs,
        )

    # --- reserving ---------------------------------------------------------------------------

    def reserve(self) -> ResourceManager:
        """Check the cluster, create one pinned placement group per node, wait (bounded)."""
        if self.placement_groups:
            return self
        start = time.perf_counter()
        self.nodes = match_nodes(self.plan, [NodeInfo.from_ray(n) for n in ray.nodes()])
        self._check_available()
        for node, info in self.nodes.items():
            bundles = self.plan.bundles(node)
            self.placement_groups[node] = placement_group(
                bundles,
                strategy="STRICT_PACK",
                name=f"roll_ds-node{node}",
                bundle_label_selector=[{NODE_ID_LABEL: info.node_id}] * len(bundles),
            )
        self._wait_ready()
        if self.visible_devices_env and self._has_multi_device_workers():
            self._probe_device_ids()
        self.reserve_s = time.perf_counter() - start
        return self

    def needed(self) -> dict[str, float]:
        """The Ray resources the bundles take: the device resource, and CPUs beside GPUs."""
        resource = self.plan.device_resource
        need = {resource: float(self.plan.num_devices)}
        cpu = self.plan.bundle_resources().get("CPU", 0.0) * self.plan.num_devices
        if resource != "CPU" and cpu:
            need["CPU"] = cpu
        return need

    def _check_available(self) -> None:
        """Fail before creating anything when the free resources cannot hold the bundles."""
        free = ray.available_resources()
        for key, amount in self.needed().items():
            if free.get(key, 0.0) + 1e-9 < amount:
                raise PlacementError(
                    f"placement needs {amount:g} {key} for {self.plan.num_devices} device "
                    f"bundle(s) on node(s) {self.plan.nodes}, but only {free.get(key, 0.0):g} "
                    f"{key} are free in the Ray cluster (total "
                    f"{ray.cluster_resources().get(key, 0.0):g}); something else holds the rest"
                    + ("; or lower cpus_per_gpu" if key == "CPU" else "")
                )

    @staticmethod
    def wait_free(need: dict[str, float], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until Ray has ``need`` free: after a teardown it returns
        killed actors' and removed placement groups' resources asynchronously, and a new
        reservation checked at once finds them still held. Whether they came back."""
        deadline = time.monotonic() + timeout_s
        while True:
            free = ray.available_resources()
            if all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def _wait_ready(self) -> None:
        pending = {pg.ready(): node for node, pg in self.placement_groups.items()}
        ready, not_ready = ray.wait(
            list(pending), num_returns=len(pending), timeout=self.ready_timeout_s
        )
        if not_ready:
            late = sorted(pending[ref] for ref in not_ready)
            detail = "; ".join(
                f"node {n} -> {self.nodes[n].describe(self.plan.device_resource)}: "
                f"{len(self.plan.node_devices[n])} bundle(s) of {self.plan.bundle_resources()}"
                for n in late
            )
            free = ray.available_resources()
            self.release()
            raise PlacementError(
                f"placement group(s) for node(s) {late} not ready after {self.ready_timeout_s:g} s "
                f"({detail}); free now: {self.plan.device_resource}="
                f"{free.get(self.plan.device_resource, 0):g}, CPU={free.get('CPU', 0):g}"
            )
        ray.get(ready)

    def _has_multi_device_workers(self) -> bool:
        return any(len(s.devices) > 1 for slots in self.plan.slots.values() for s in slots)

    def _probe_device_ids(self) -> None:
        """Ask each bundle which device Ray reserved for it (for multi-device workers' env)."""
        resource = self.plan.device_resource

        @ray.remote(num_cpus=0)
        def device_ids() -> list[str]:
            return ray.get_runtime_context().get_accelerator_ids().get(resource, [])

        refs = {}
        for node, pg in self.placement_groups.items():
            for bundle in range(len(self.plan.node_devices[node])):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
                refs[(node, bundle)] = device_ids.options(
                    resources={resource: 1e-4} if resource != "GPU" else None,
                    num_gpus=1e-4 if resource == "GPU" else None,
                    scheduling_strategy=strategy,
                ).remote()
        got = ray.get(list(refs.values()), timeout=self.ready_timeout_s)
        for (node, _bundle), ids in zip(refs, got, strict=True):
            self.bundle_device_ids.setdefault(node, []).append(",".join(ids))

    def release(self) -> None:
        for pg in self.placement_groups.values():
            with contextlib.suppress(Exception):  # best effort on teardown: Ray may be gone
                remove_placement_group(pg)
        self.placement_groups.clear()

    # --- handing out ---------------------------------------------------------------------------

    def placements(self, role: str) -> list[ActorPlacement]:
        """Scheduling options of every rank of ``role`` (reserves first if needed)."""
        if role not in self.plan.slots:
            raise KeyError(f"no role {role!r} in the plan; planned: {sorted(self.plan.slots)}")
        self.reserve()
        return [self._placement(slot) for slot in self.plan.slots[role]]

    def _placement(self, slot: WorkerSlot) -> ActorPlacement:
        if slot.node is None:
            return ActorPlacement(slot, None, None, {"num_cpus": slot.cpu_share}, {})
        resource = self.plan.device_resource
        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placement_groups[slot.node],
                placement_group_bundle_index=slot.bundle,
                placement_group_capture_child_tasks=False,
            )
        }
        if resource == "CPU":
            options["num_cpus"] = slot.cpu_share
        else:
            options["num_cpus"] = slot.cpu_share
            if resource == "GPU":
                options["num_gpus"] = slot.device_share
            else:
                options["resources"] = {resource: slot.device_share}
        env: dict[str, str] = {DEVICE_ENV: self.platform.device_type} if self.platform else {}
        if len(slot.devices) > 1 and self.visible_devices_env:
            # Ray exposes only the first bundle's device; Cluster sets the full list in the actor
            # before Worker.__init__ (CUDA reads it at its first use, not at import).
            ids = [self.bundle_device_ids[slot.node][b] for b in slot.bundles]
            env[self.visible_devices_env] = ",".join(ids)
        info = self.nodes[slot.node]
        defaults = self.platform.process_env() if self.platform else {}
        return ActorPlacement(slot, info.node_id, info.ip, options, env, defaults)

    def describe(self) -> str:
        """The plan with the Ray node each logical node got (after ``reserve``)."""
        return format_plan(self.plan, self.nodes)

    def bundle_node_ids(self, node: int) -> dict[int, str]:
        """Bundle index -> Ray node id as the GCS reports it (for checks and debugging)."""
        return dict(placement_group_table(self.placement_groups[node])["bundles_to_node_id"])
