"""Which transport ``weight_sync.transport: auto`` means for a placement, and building it.

    GPU, every vLLM worker's GPU also holds an actor_train rank (colocated) -> cuda_ipc: each
        worker reads the buckets of the train rank on its own GPU (matched by GPU UUID)
    GPU, no vLLM worker shares a GPU with actor_train                      -> collective (NCCL)
    GPU, some share and some do not                                        -> refused (below)
    CPU, every rollout worker on train rank 0's node                       -> object_store
    CPU across nodes                                                       -> collective (gloo)

Devices are compared by GPU UUID (``roll_ds.distributed.devices``; Ray's GPU ids are per node and
``CUDA_VISIBLE_DEVICES`` renumbers them). A named transport is checked against the placement:
``collective`` is refused where a receiver shares train rank 0's GPU (NCCL refuses two ranks of
one communicator on one device, "Duplicate GPU detected"), ``cuda_ipc`` where a receiver's GPU
holds no train rank. A partly colocated layout has no single transport that is both legal and
cheap, so ``auto`` refuses it, naming the ranks; ``object_store`` (through host memory) still
works there when named.

On CPU the same-node choice is measured (``benchmarks/weight_sync.py``): Ray's shared-memory
object store reads zero-copy and beat a gloo broadcast over loopback TCP at every model size;
across nodes both cross the network once, and the group streams (rank 0 holds one bucket at a
time, no object store spilling).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from roll_ds.distributed.devices import normalize_uuid
from roll_ds.weight_sync import AUTO, TRANSPORTS, check_transport_name

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig, WeightSyncConfig
    from roll_ds.distributed.cluster import Cluster
    from roll_ds.weight_sync.base import Transport

logger = logging.getLogger(__name__)

FIX_COLOCATED = (
    "set weight_sync.transport=cuda_ipc (or auto) so that each vLLM worker reads from the "
    "actor_train rank on its own GPU, or give actor_infer a device_mapping disjoint from "
    "actor_train's"
)


@dataclass(frozen=True)
class Endpoint:
    """Where a worker runs: its Ray node, the GPU ids Ray gave it, and the UUIDs of the GPUs its
    processes use in device-index order (a tensor-parallel vLLM worker ``i`` uses the ``i``-th);
    both empty on CPU."""

    node_id: str | None
    gpus: tuple[str, ...] = ()
    uuids: tuple[str, ...] = ()

    @classmethod
    def of(cls, info: dict) -> Endpoint:
        gpus = (info.get("accelerator_ids") or {}).get("GPU") or ()
        uuids = tuple(normalize_uuid(u) for u in info.get("gpu_uuids") or ())
        return cls(info.get("node_id"), tuple(str(g) for g in gpus), uuids)

    @property
    def devices(self) -> tuple[str, ...]:
        """What identifies its GPUs across processes: the UUIDs; without them (a worker that
        could not read them) node-qualified Ray ids, right unless CUDA_VISIBLE_DEVICES was
        changed by hand."""
        return self.uuids or tuple(f"{self.node_id}/gpu{g}" for g in self.gpus)


def choose_transport(
    requested: str, *, is_cuda: bool, senders: Sequence[Endpoint], receivers: Sequence[Endpoint]
) -> tuple[str, str]:
    """``(transport name, why)`` for ``requested`` (a name or ``auto``); ``senders``: every
    actor_train rank in rank order, ``receivers``: every rollout worker. Raises ``ValueError``
    naming ``weight_sync.transport`` and the fix where the placement rules the transport out."""
    check_transport_name(requested)
    if requested == "cuda_ipc" and not is_cuda:
        raise ValueError("weight_sync.transport=cuda_ipc needs CUDA GPUs; none are in use")
    if not is_cuda:
        if requested != AUTO:
            return requested, "named in weight_sync.transport"
        if all(r.node_id == senders[0].node_id for r in receivers):
            return "object_store", "CPU, one node: shared-memory object store (zero-copy reads)"
        return "collective", "CPU across nodes: gloo broadcast group (streams bucket by bucket)"
    return _choose_on_gpu(requested, senders, receivers)


def _choose_on_gpu(
    requested: str, senders: Sequence[Endpoint], receivers: Sequence[Endpoint]
) -> tuple[str, str]:
    train_ranks = train_rank_by_device(senders)
    rank0 = set(senders[0].devices)
    on_rank0 = [i for i, r in enumerate(receivers) if rank0 & set(r.devices)]
    lonely = {
        i: [d for d in r.devices if d not in train_ranks]
        for i, r in enumerate(receivers)
        if any(d not in train_ranks for d in r.devices)
    }
    shared = [i for i, r in enumerate(receivers) if any(d in train_ranks for d in r.devices)]
    if requested == "collective" and on_rank0:
        raise ValueError(
            f"weight_sync.transport=collective: actor_infer rank(s) {on_rank0} use the GPU of "
            "actor_train rank 0, the sender of the NCCL group, and NCCL refuses two ranks of one "
            f"group on one GPU ('Duplicate GPU detected'); {FIX_COLOCATED}"
        )
    if requested == "cuda_ipc" and lonely:
        raise ValueError(
            f"weight_sync.transport=cuda_ipc: {_describe(lonely)} hold(s) no actor_train rank, "
            "so there is no train rank to read the weights from by CUDA IPC; use "
            "weight_sync.transport=collective (NCCL) for roles on separate GPUs, or put "
            "actor_infer's device_mapping inside actor_train's"
        )
    if requested != AUTO:
        if requested == "object_store":
            logger.warning(
                "weight_sync.transport=object_store on GPUs: every sync copies the whole model "
                "through host memory, once per vLLM worker (see the figure logged at the "
                "first sync); cuda_ipc (colocated) or collective (separate GPUs) do not"
            )
        return requested, "named in weight_sync.transport"
    if not lonely:
        return "cuda_ipc", "colocated: every vLLM worker reads the train rank on its own GPU"
    if not shared:
        return "collective", "GPUs not shared with actor_train: NCCL broadcast group"
    raise ValueError(
        f"weight_sync.transport=auto: actor_infer rank(s) {shared} share GPUs with actor_train "
        f"but {_describe(lonely)} do(es) not, and no one transport serves both (cuda_ipc needs "
        "a train rank on every receiving GPU; NCCL refuses a receiver on its sender's GPU). "
        "Make actor_infer's device_mapping a subset of actor_train's (cuda_ipc) or disjoint "
        "from it (collective), or name weight_sync.transport=object_store (through host memory)"
    )


def train_rank_by_device(senders: Sequence[Endpoint]) -> dict[str, int]:
    """GPU -> the lowest actor_train rank on it."""
    out: dict[str, int] = {}
    for rank, endpoint in enumerate(senders):
        for device in endpoint.devices:
            out.setdefault(device, rank)
    return out


def _describe(lonely: dict[int, list[str]]) -> str:
    parts = [f"actor_infer rank {i} (GPU {', '.join(d)})" for i, d in sorted(lonely.items())]
    if len(parts) > 4:
        parts = [*parts[:3], f"... {len(parts) - 3} more"]
    return "; ".join(parts)


def layout_problems(cfg: RLVRConfig) -> list[str]:
    """The transport rules of ``choose_transport`` applied to the config's device ids, for a run
    declared ``device: cuda`` (checked before any actor starts; under ``device: auto`` whether
    the ids are GPUs is only known from the cluster, and ``build_transport`` checks the same
    rules there by GPU UUID). Global device ids name one GPU each."""
    from roll_ds.config.device_mapping import DeviceMappingError, parse_device_mapping

    if getattr(cfg, "device", "auto") != "cuda" or cfg.actor_infer is None:
        return []
    if cfg.weight_sync.transport not in (AUTO, *TRANSPORTS):
        return []  # reported by the transport name check
    try:
        train = parse_device_mapping(cfg.actor_train.device_mapping)
        infer = parse_device_mapping(cfg.actor_infer.device_mapping)
    except DeviceMappingError:
        return []  # reported by the device_mapping checks
    per_worker = max(1, cfg.actor_infer.num_gpus_per_worker)
    if not train or not infer or len(infer) % per_worker:
        return []
    senders = [Endpoint(None, uuids=(f"device {d}",)) for d in train]
    receivers = [
        Endpoint(None, uuids=tuple(f"device {d}" for d in infer[i : i + per_worker]))
        for i in range(0, len(infer), per_worker)
    ]
    try:
        choose_transport(
            cfg.weight_sync.transport, is_cuda=True, senders=senders, receivers=receivers
        )
    except ValueError as exc:
        return [str(exc)]
    return []


def build_transport(
    cfg: WeightSyncConfig, train: Cluster, infer: Cluster, *, rollout_dtype: str | None
) -> Transport:
    """The configured transport for these roles, connected (with ``lora_sync: adapter`` the
    rollout workers are given the policy's adapter config)."""
    from roll_ds.platform import current_platform

    name, why = choose_transport(
        cfg.transport,
        is_cuda=current_platform().is_cuda,
        senders=[Endpoint.of(info) for info in train.infos],
        receivers=[Endpoint.of(info) for info in infer.infos],
    )
    logger.info("weight sync: transport %s (%s)", name, why)
    transport = TRANSPORTS.get(name)(
        bucket_bytes=cfg.bucket_bytes,
        timeout_s=cfg.timeout_s,
        rollout_dtype=rollout_dtype,
        adapter_only=cfg.lora_sync == "adapter",
        min_gib_per_s=cfg.min_gib_per_s,
    )
    # every sync's bound: timeout_s + these bytes at min_gib_per_s (base.SyncBound)
    transport.sync_bytes = train.weight_sync_nbytes(rollout_dtype, transport.adapter_only)
    logger.info(
        "weight sync: %d bytes a sync, bound %s", transport.sync_bytes, transport.bound.describe()
    )
    transport.connect(train, infer)
    if transport.adapter_only:  # the receivers write what they get as this peft adapter
        infer.enable_adapter_sync(train.adapter_config())
    return transport
