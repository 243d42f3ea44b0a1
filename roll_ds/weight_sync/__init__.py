"""Weight sync: the policy's full weights from actor_train into every rollout engine.

One sync = actor_train gathers HF-named weights bucket by bucket (ZeRO-3 ``GatheredParameters``,
LoRA merged, tied head under both names), a transport moves the buckets, and each vLLM worker
reloads the whole model from *one* iterator the buckets are chained into, then drops its prefix
cache. Transports, chosen by ``weight_sync.transport`` (``auto`` picks from placement and device,
see ``select.py``):

    object_store  Ray's object store: rank 0 puts each bucket, receivers read them zero-copy on
                  the same node (the cross-node fallback; works with any rollout strategy)
    collective    a broadcast group between train rank 0 and every vLLM worker, built apart from
                  the training world (gloo on CPU, NCCL on GPU), every op bounded by a timeout;
                  buckets stream: rank 0 holds one bucket at a time
    cuda_ipc      colocated GPU workers: each vLLM worker reads the buckets of the train rank on
                  its own GPU (paired by GPU UUID; one group per GPU) through CUDA IPC handles of
                  one buffer per sync, released after it; a gloo group for control (GPU
                  only)

Each transport is three classes registered under its name: the driver's ``Transport``
(``TRANSPORTS``), actor_train rank 0's ``Sender`` (``SENDERS``) and each rollout worker's
``Receiver`` (``RECEIVERS``); ``base.py`` describes the layout. The group transports move bucket
buffers by a data plane (``PLANES``: a broadcast, or CUDA IPC).

Under LoRA, ``weight_sync.lora_sync: adapter`` ships the adapter alone instead (``adapter.py``):
the engine keeps its base weights and serves base + adapter with vLLM's LoRA support.

``parity.py`` checks a sync: vLLM's and the trainer's log-probs on a fixed probe batch.

Light on purpose: importing this package imports neither torch nor Ray.
"""

from __future__ import annotations

from roll_ds.registry import Registry

TRANSPORTS: Registry[type] = Registry("weight_sync.transport")  # driver side: Transport
SENDERS: Registry[type] = Registry("weight-sync sender")  # actor_train rank 0: Sender
RECEIVERS: Registry[type] = Registry("weight-sync receiver")  # rollout workers: Receiver
PLANES: Registry[type] = Registry("weight-sync data plane")  # how a group moves bucket bytes

_M = "roll_ds.weight_sync"
TRANSPORTS.register_lazy("object_store", f"{_M}.object_store:ObjectStoreTransport")
TRANSPORTS.register_lazy("collective", f"{_M}.collective:CollectiveTransport")
TRANSPORTS.register_lazy("cuda_ipc", f"{_M}.cuda_ipc:CudaIpcTransport")
SENDERS.register_lazy("object_store", f"{_M}.object_store:ObjectStoreSender")
SENDERS.register_lazy("collective", f"{_M}.collective:CollectiveSender")
SENDERS.register_lazy("cuda_ipc", f"{_M}.cuda_ipc:CudaIpcSender")
RECEIVERS.register_lazy("object_store", f"{_M}.object_store:ObjectStoreReceiver")
RECEIVERS.register_lazy("collective", f"{_M}.collective:CollectiveReceiver")
RECEIVERS.register_lazy("cuda_ipc", f"{_M}.cuda_ipc:CudaIpcReceiver")
PLANES.register_lazy("broadcast", f"{_M}.collective:BroadcastPlane")
PLANES.register_lazy("cuda_ipc", f"{_M}.cuda_ipc:IpcPlane")

AUTO = "auto"


def check_transport_name(name: str) -> None:
    """Raise listing the valid names (``auto`` included) unless ``name`` is one of them."""
    if name != AUTO and name not in TRANSPORTS:
        raise ValueError(
            f"unknown weight_sync.transport {name!r}; valid: {', '.join([AUTO, *TRANSPORTS])}"
        )
