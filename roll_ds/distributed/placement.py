"""Pure placement planning: roles' device ids -> nodes, bundles and per-actor resource shares.

No Ray calls here, so every rule is unit-tested without a cluster
(``tests/unit/distributed/test_resource_plan.py``).

Rules:
- Device ids are global: id ``d`` lives on logical node ``d // num_gpus_per_node`` as local device
  ``d % num_gpus_per_node``.
- Each logical node gets one placement group with one bundle per local device that some role uses
  (``{device_resource: 1, "CPU": cpus_per_device}``; on CPU machines the device *is* a CPU slot, so
  the bundle is ``{"CPU": 1}``).
- Worker ``r`` of a role owns devices ``devices[r*k:(r+1)*k]`` (k = devices per worker), all on one
  node. It is scheduled into the bundle of its first device.
- Roles whose ids overlap share those bundles: on a device used by ``n`` roles each actor asks
  ``1/n`` of the bundle (rounded down to Ray's 1e-4 resource grain so the shares always fit).
- Roles without devices (reward workers) are plain CPU actors asking ``cpus_per_cpu_worker`` CPUs.
- Logical nodes map to Ray nodes in a fixed order: nodes with at least ``num_gpus_per_node``
  devices, head first, then by IP and node id (``match_nodes``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from roll_ds.distributed.errors import PlacementError

RESOURCE_GRAIN = 1e-4  # Ray's fixed-point resource precision


@dataclass(frozen=True)
class RoleSpec:
    """What a role needs, flattened from its config (see ``role_specs_from_config``)."""

    devices: tuple[int, ...] = ()  # global device ids; empty: CPU-only role
    world_size: int = 1
    devices_per_worker: int = 1  # ignored for CPU-only roles

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker (rank) of a role goes and what it asks for."""

    role: str
    rank: int
    devices: tuple[int, ...]  # global ids; empty for CPU-only roles
    node: int | None  # logical node index; None: anywhere (CPU-only roles)
    local_devices: tuple[int, ...]  # devices % num_gpus_per_node
    bundles: tuple[int, ...]  # bundle index of each device in its node's placement group
    node_local_rank: int  # rank among this role's workers on the same node
    device_share: float  # of the first bundle's device resource (0 for CPU-only roles)
    cpu_share: float  # CPUs the actor asks for

    @property
    def bundle(self) -> int | None:
        """The bundle the actor is scheduled into (its first device's)."""
        return self.bundles[0] if self.bundles else None


@dataclass(frozen=True)
class PlacementPlan:
    num_gpus_per_node: int
    device_resource: str  # Ray resource a device stands for: "GPU" or "CPU"
    cpus_per_device: float
    node_devices: dict[int, tuple[int, ...]]  # logical node -> local devices (= its bundles)
    slots: dict[str, tuple[WorkerSlot, ...]]
    sharing: dict[int, tuple[str, ...]] = field(default_factory=dict)  # device -> roles on it

    @property
    def nodes(self) -> list[int]:
        return sorted(self.node_devices)

    def bundle_resources(self) -> dict[str, float]:
        """Resources of one bundle (one device)."""
        if self.device_resource == "CPU":
            return {"CPU": 1.0}
        bundle = {self.device_resource: 1.0}
        if self.cpus_per_device > 0:
            bundle["CPU"] = float(self.cpus_per_device)
        return bundle

    def bundles(self, node: int) -> list[dict[str, float]]:
        return [self.bundle_resources() for _ in self.node_devices[node]]

    @property
    def num_devices(self) -> int:
        return sum(len(d) for d in self.node_devices.values())

    def cpu_only_cpus(self) -> float:
        """CPUs asked by CPU-only roles' actors (outside placement groups)."""
        return sum(s.cpu_share for slots in self.slots.values() for s in slots if s.node is None)

    def total_cpus(self) -> float:
        """CPUs the whole plan reserves: bundles plus CPU-only actors."""
        per_bundle = self.bundle_resources().get("CPU", 0.0)
        return self.num_devices * per_bundle + self.cpu_only_cpus()


def plan_placement(
    roles: Mapping[str, RoleSpec],
    *,
    num_gpus_per_node: int,
    num_nodes: int | None = None,
    device_resource: str = "GPU",
    cpus_per_device: float = 1.0,
    cpus_per_cpu_worker: float = 0.1,
) -> PlacementPlan:
    """Plan every role's workers; raises ``PlacementError`` naming the role and the numbers."""
    if num_gpus_per_node < 1:
        raise PlacementError(f"num_gpus_per_node must be >= 1, got {num_gpus_per_node}")
    if cpus_per_cpu_worker <= 0:
        raise PlacementError(f"cpus_per_cpu_worker must be > 0, got {cpus_per_cpu_worker}")
    gpn = num_gpus_per_node
    groups, sharing = _group_devices(roles, gpn, num_nodes)
    node_devices = _node_devices(sharing, gpn)
    bundle_of = {(n, ld): i for n, lds in node_devices.items() for i, ld in enumerate(lds)}
    device_cpus = 1.0 if device_resource == "CPU" else cpus_per_device
    slots: dict[str, tuple[WorkerSlot, ...]] = {}
    for name, spec in roles.items():
        if not spec.devices:
            slots[name] = _cpu_slots(name, spec.world_size, cpus_per_cpu_worker)
        else:
            slots[name] = _device_slots(name, groups[name], sharing, bundle_of, gpn, device_cpus)
    return PlacementPlan(
        num_gpus_per_node=gpn,
        device_resource=device_resource,
        cpus_per_device=device_cpus,
        node_devices=node_devices,
        slots=slots,
        sharing={d: tuple(r) for d, r in sorted(sharing.items())},
    )


def _group_devices(
    roles: Mapping[str, RoleSpec], gpn: int, num_nodes: int | None
) -> tuple[dict[str, list[tuple[int, ...]]], dict[int, list[str]]]:
    """Each device role's worker groups, and device -> the roles on it (in role order)."""
    sharing: dict[int, list[str]] = defaultdict(list)
    groups: dict[str, list[tuple[int, ...]]] = {}
    for name, spec in roles.items():
        if not spec.devices:
            if spec.world_size < 1:
                raise PlacementError(f"{name}: a role without devices needs world_size >= 1")
            continue
        groups[name] = _worker_groups(name, spec, gpn, num_nodes)
        for d in spec.devices:
            sharing[d].append(name)
    return groups, sharing


def _node_devices(sharing: Mapping[int, list[str]], gpn: int) -> dict[int, tuple[int, ...]]:
    """Logical node -> its used local devices, sorted (bundle ``i`` is the ``i``-th)."""
    node_devices: dict[int, set[int]] = defaultdict(set)
    for d in sharing:
        node_devices[d // gpn].add(d % gpn)
    return {n: tuple(sorted(locals_)) for n, locals_ in node_devices.items()}


def _cpu_slots(name: str, world_size: int, cpus: float) -> tuple[WorkerSlot, ...]:
    """A CPU-only role's actors: anywhere, ``cpus`` each."""
    return tuple(WorkerSlot(name, r, (), None, (), (), r, 0.0, cpus) for r in range(world_size))


def _device_slots(
    name: str,
    groups: list[tuple[int, ...]],
    sharing: Mapping[int, list[str]],
    bundle_of: Mapping[tuple[int, int], int],
    gpn: int,
    device_cpus: float,
) -> tuple[WorkerSlot, ...]:
    """A device role's workers: node, bundles and the share of their first device's bundle."""
    per_node_count: dict[int, int] = defaultdict(int)
    role_slots = []
    for rank, group in enumerate(groups):
        node = group[0] // gpn
        local = tuple(d % gpn for d in group)
        share = _share(len(sharing[group[0]]))
        role_slots.append(
            WorkerSlot(
                role=name,
                rank=rank,
                devices=group,
                node=node,
                local_devices=local,
                bundles=tuple(bundle_of[(node, ld)] for ld in local),
                node_local_rank=per_node_count[node],
                device_share=share,
                cpu_share=_round_down(device_cpus * share),
            )
        )
        per_node_count[node] += 1
    return tuple(role_slots)


def _worker_groups(
    name: str, spec: RoleSpec, gpn: int, num_nodes: int | None
) -> list[tuple[int, ...]]:
    devices, k = spec.devices, spec.devices_per_worker
    if k < 1:
        raise PlacementError(f"{name}: devices_per_worker must be >= 1, got {k}")
    if len(set(devices)) != len(devices):
        raise PlacementError(f"{name}: device ids repeat in {list(devices)}")
    if len(devices) != spec.world_size * k:
        raise PlacementError(
            f"{name}: {len(devices)} devices != world_size {spec.world_size} x devices_per_worker "
            f"{k} = {spec.world_size * k}"
        )
    if num_nodes is not None:
        beyond = [d for d in devices if d >= num_nodes * gpn]
        if beyond:
            raise PlacementError(
                f"{name}: device ids {beyond} are beyond num_nodes {num_nodes} x "
                f"num_gpus_per_node {gpn} = {num_nodes * gpn} devices"
            )
    groups = [tuple(devices[i : i + k]) for i in range(0, len(devices), k)]
    for group in groups:
        if len({d // gpn for d in group}) > 1:
            raise PlacementError(
                f"{name}: worker devices {list(group)} span nodes "
                f"{sorted({d // gpn for d in group})} (num_gpus_per_node {gpn}); a worker's "
                "devices must sit on one node"
            )
    return groups


def _share(num_roles: int) -> float:
    return _round_down(1.0 / num_roles)


def _round_down(value: float) -> float:
    return math.floor(value / RESOURCE_GRAIN + 1e-9) * RESOURCE_GRAIN


# --- Ray nodes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeInfo:
    """A Ray node as ``ray.nodes()`` describes it (only what placement needs)."""

    node_id: str
    ip: str
    resources: dict[str, float]
    is_head: bool = False
    alive: bool = True

    @classmethod
    def from_ray(cls, entry: Mapping) -> NodeInfo:
        resources = dict(entry.get("Resources", {}))
        return cls(
            node_id=entry["NodeID"],
            ip=entry.get("NodeManagerAddress", "?"),
            resources=resources,
            is_head="node:__internal_head__" in resources,
            alive=bool(entry.get("Alive", True)),
        )

    def describe(self, resource: str) -> str:
        return f"node {self.node_id[:8]} ({self.ip}) {resource}={self.resources.get(resource, 0):g}"


def _ip_key(ip: str) -> tuple:
    parts = ip.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else (ip,)


def order_nodes(nodes: Sequence[NodeInfo], resource: str, per_node: int) -> list[NodeInfo]:
    """Alive nodes with at least ``per_node`` of ``resource``: head first, then by IP, node id."""
    eligible = [n for n in nodes if n.alive and n.resources.get(resource, 0) >= per_node]
    return sorted(eligible, key=lambda n: (not n.is_head, _ip_key(n.ip), n.node_id))


CPU_HEADROOM_PER_NODE = 1.0  # CPUs per GPU node left out of the bundles (rewards, probes, Ray)


def cpus_per_gpu(nodes: Sequence[NodeInfo], num_gpus_per_node: int, num_nodes: int) -> float:
    """CPUs each GPU bundle reserves when the config leaves it to the cluster.

    The GPU nodes' CPUs split evenly over ``num_gpus_per_node`` devices, less
    ``CPU_HEADROOM_PER_NODE`` per node; the smallest of the ``num_nodes`` nodes placement will
    use decides, so every node fits. Whole CPUs (they become thread counts: DeepSpeed's CPU Adam
    under offload runs on them); below one CPU per GPU, the exact share without headroom.
    E.g. 8 GPUs and 64 CPUs per node -> 7.
    """
    ordered = order_nodes(nodes, "GPU", num_gpus_per_node)[:num_nodes]
    if not ordered:
        return 1.0  # match_nodes reports the missing nodes
    cpus = min(n.resources.get("CPU", 0.0) for n in ordered)
    per_gpu = (cpus - CPU_HEADROOM_PER_NODE) / num_gpus_per_node
    if per_gpu >= 1:
        return float(math.floor(per_gpu))
    return _round_down(cpus / num_gpus_per_node)


def match_nodes(plan: PlacementPlan, nodes: Sequence[NodeInfo]) -> dict[int, NodeInfo]:
    """Logical node -> Ray node; raises ``PlacementError`` with the numbers when it cannot fit."""
    resource, gpn = plan.device_resource, plan.num_gpus_per_node
    ordered = order_nodes(nodes, resource, gpn)
    if not plan.nodes:
        return {}
    needed = max(plan.nodes) + 1
    if len(ordered) < needed:
        ids = sorted(d for d in plan.sharing)
        have = ", ".join(n.describe(resource) for n in nodes if n.alive) or "no alive nodes"
        raise PlacementError(
            f"device_mapping needs {needed} node(s) with >= {gpn} {resource} each (device ids "
            f"{_span(ids)} with num_gpus_per_node {gpn} -> nodes 0-{needed - 1}), but the Ray "
            f"cluster has {len(ordered)} such node(s): {have}. Lower the device ids, lower "
            "num_gpus_per_node, or add nodes"
        )
    total_cpus = sum(n.resources.get("CPU", 0) for n in nodes if n.alive)
    if plan.total_cpus() > total_cpus + 1e-9:
        raise PlacementError(
            f"placement needs {plan.total_cpus():g} CPUs ({plan.num_devices} device bundles x "
            f"{plan.bundle_resources().get('CPU', 0):g} + {plan.cpu_only_cpus():g} for CPU-only "
            f"workers), the Ray cluster has {total_cpus:g}. Lower cpus_per_gpu / "
            "cpus_per_cpu_worker or start Ray with more CPUs (ray.num_cpus)"
        )
    return {i: ordered[i] for i in plan.nodes}


def _span(ids: list[int]) -> str:
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return str(ids)


def format_plan(plan: PlacementPlan, nodes: Mapping[int, NodeInfo] | None = None) -> str:
    """The plan as text: one line per node, then one per role (``rank@node:[local devices]``)."""
    lines = []
    for n in plan.nodes:
        where = f" -> {nodes[n].describe(plan.device_resource)}" if nodes and n in nodes else ""
        global_ids = [n * plan.num_gpus_per_node + d for d in plan.node_devices[n]]
        lines.append(
            f"node {n}: devices {_span(global_ids)} = local {_span(list(plan.node_devices[n]))}, "
            f"bundles of {plan.bundle_resources()}{where}"
        )
    for role, slots in plan.slots.items():
        if slots and slots[0].node is None:
            lines.append(f"{role}: {len(slots)} CPU actor(s) x {slots[0].cpu_share:g} CPU")
            continue
        cells = " ".join(f"r{s.rank}@n{s.node}:{_span(list(s.local_devices))}" for s in slots)
        shares = sorted({s.device_share for s in slots})
        lines.append(f"{role}: {cells}  ({plan.device_resource} share {shares})")
    return "\n".join(lines)
