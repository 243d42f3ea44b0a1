"""Which transport ``weight_sync.transport: auto`` means for a placement, and building it.

    GPU, every rollout worker sees train rank 0's GPU (colocated)   -> cuda_ipc
    GPU otherwise                                                    -> collective (NCCL)
    CPU, every rollout worker on train rank 0's node                 -> object_store
    CPU across nodes                                                 -> collective (gloo)

On CPU the same-node choice is measured (``benchmarks/weight_sync.py``): Ray's shared-memory
object store reads zero-copy and beat a gloo broadcast over loopback TCP at every model size;
across nodes both cross the network once, and the group streams (rank 0 holds one bucket at a
time, no object store spilling). A transport named explicitly is used as is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from roll_ds.weight_sync import AUTO, TRANSPORTS, check_transport_name

if TYPE_CHECKING:
    from roll_ds.config.schema import WeightSyncConfig
    from roll_ds.distributed.cluster import Cluster
    from roll_ds.weight_sync.base import Transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """Where a worker runs: its Ray node and the GPU ids Ray gave it (empty on CPU)."""

    node_id: str | None
    gpus: tuple[str, ...] = ()

    @classmethod
    def of(cls, info: dict) -> Endpoint:
        gpus = (info.get("accelerator_ids") or {}).get("GPU") or ()
        return cls(info.get("node_id"), tuple(str(g) for g in gpus))


def choose_transport(
    requested: str, *, is_cuda: bool, sender: Endpoint, receivers: Sequence[Endpoint]
) -> tuple[str, str]:
    """``(transport name, why)`` for ``requested`` (a name or ``auto``)."""
    check_transport_name(requested)
    if requested == "cuda_ipc" and not is_cuda:
        raise ValueError("weight_sync.transport=cuda_ipc needs CUDA GPUs; none are in use")
    if requested != AUTO:
        return requested, "named in weight_sync.transport"
    same_node = all(r.node_id == sender.node_id for r in receivers)
    if is_cuda:
        colocated = (
            same_node
            and bool(sender.gpus)
            and all(set(sender.gpus) & set(r.gpus) for r in receivers)
        )
        if colocated:
            return "cuda_ipc", "every rollout worker shares train rank 0's GPU"
        return "collective", "GPUs not shared with train rank 0: NCCL broadcast group"
    if same_node:
        return "object_store", "CPU, one node: shared-memory object store (zero-copy reads)"
    return "collective", "CPU across nodes: gloo broadcast group (streams bucket by bucket)"


def build_transport(
    cfg: WeightSyncConfig, train: Cluster, infer: Cluster, *, rollout_dtype: str | None
) -> Transport:
    """The configured transport for these roles, connected (with ``lora_sync: adapter`` the
    rollout workers are given the policy's adapter config)."""
    from roll_ds.platform import current_platform

    name, why = choose_transport(
        cfg.transport,
        is_cuda=current_platform().is_cuda,
        sender=Endpoint.of(train.infos[0]),
        receivers=[Endpoint.of(info) for info in infer.infos],
    )
    logger.info("weight sync: transport %s (%s)", name, why)
    transport = TRANSPORTS.get(name)(
        bucket_bytes=cfg.bucket_bytes,
        timeout_s=cfg.timeout_s,
        rollout_dtype=rollout_dtype,
        adapter_only=cfg.lora_sync == "adapter",
    )
    transport.connect(train, infer)
    if transport.adapter_only:  # the receivers write what they get as this peft adapter
        infer.enable_adapter_sync(train.adapter_config())
    return transport
