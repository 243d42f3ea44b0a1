"""Weight sync into the engine: ``WeightSyncMixin`` holds ``VllmStrategy``'s receiving side
(``strategies/vllm/strategy.py`` starts and stops the engine).

A sync replaces the served weights in place (vLLM's layer-wise reload, run in every vLLM worker
by ``RollDsWorkerExtension``, ``strategies/vllm/worker_ext.py``) and then drops the prefix cache,
whose KV was computed with the old weights. The weights arrive either through this process
(``load_weights``: the ``object_store`` transport) or straight into the engine's workers, each a
member of a weight-sync group (``join_transfer_group`` / ``receive_from_group``: ``collective``,
``cuda_ipc``). With ``weight_sync.lora_sync: adapter`` a sync carries the LoRA adapter alone,
which is written to a new directory and served on top of the base weights instead.

Under streaming generation a reload runs between two decode steps of the paused request stream
(``strategies/vllm/stream.py``): the requests in flight are preempted with the KV cache and
recompute their prefix with the new weights when they resume.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from roll_ds.platform import current_platform
from roll_ds.weight_sync.adapter import AdapterVersions, write_adapter
from roll_ds.weight_sync.wire import (
    adapter_to_wire,
    seats_to_wire,
    tensors_to_wire,
    wire_nbytes,
)
from strategies.vllm.stream import RequestStream

if TYPE_CHECKING:
    import torch

    from roll_ds.weight_sync.endpoint import Seat

logger = logging.getLogger(__name__)

# A sync through the rollout actor's process (object_store) on GPU larger than this logs its
# host-memory cost.
HOST_COPY_WARN_BYTES = 1 << 30
# vLLM's LoRAConfig.max_lora_rank values (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_LORA_NAME = "roll_ds_policy"


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that fits a rank-``rank`` adapter."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(
            f"actor_train.model_args.lora_rank={rank}: vLLM serves adapters of rank "
            f"{VLLM_LORA_RANKS[0]}..{VLLM_LORA_RANKS[-1]}; use weight_sync.lora_sync=merged"
        )
    return fits[0]


def host_copies(workers: int) -> int:
    """About how many host copies of the model one ``load_weights`` makes across vLLM's
    process boundary (``roll_ds.weight_sync.wire``): the message frame here, then in the engine
    process the received frame and the decoded chunks; with tensor parallel > 1 the engine
    forwards the call to its worker processes (vLLM's shared-memory queue pickles it: the
    pickle stream and its copy out, then each worker's received copy and its unpickled
    chunks)."""
    return 3 if workers == 1 else 5 + 2 * workers


class WeightSyncMixin:
    """``VllmStrategy``'s side of a weight sync; see the module docstring."""

    # The engine's workers join weight-sync groups and receive there themselves
    # (roll_ds.weight_sync.endpoint.EngineWorkersReceiver; the group methods below).
    receives_in_engine_workers = True

    # VllmStrategy provides these (and _require_initialized / _require_awake)
    llm: Any  # the vllm.LLM
    tensor_parallel_size: int
    adapter_rank: int | None
    _in_process: bool  # engine core and its only worker in this process
    _adapters: AdapterVersions | None
    _lora_request: Any
    _stream: RequestStream | None

    # every reload: the engine, between two stream steps if streaming; then no stale KV

    def _engine_rpc(self) -> contextlib.AbstractContextManager[Any]:
        """The engine for a weight reload: directly, or between two steps of the request
        stream, which must be paused when requests are in flight (the new weights would
        otherwise land under them unannounced, their tokens labelled with the old version)."""
        if self._stream is None:
            return contextlib.nullcontext(self.llm)
        if self._stream.unfinished > 0 and not self._stream.paused:
            raise RuntimeError(
                "a weight reload under streaming generation needs pause_generation() first "
                f"({self._stream.unfinished} requests in flight)"
            )
        return self._stream.engine_call()

    def _reset_kv_after_reload(self, llm: Any) -> None:
        """Drop the KV computed with the old weights. Requests in flight in the stream are
        preempted too and recompute their prefix with the new weights when they resume."""
        running = self._stream is not None and self._stream.unfinished > 0
        if not llm.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")

    # object_store: the weights come through this process

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Replace the served weights with the *full* model, HF names, and drop the prefix cache
        (KV computed with the old weights). One iterator per sync: buckets can be chained into
        it. A tied input embedding is also loaded as ``lm_head.weight``; a weight missing from
        the iterator raises instead of leaving the old tensor served. Returns worker 0's counts
        (``num_tensors``, ``bytes``, ``seconds``, ``tied_lm_head``)."""
        self._require_awake("weights")
        if self._adapters is not None:
            stats = write_adapter(named_tensors, self._adapters.config, self._adapters.next_dir())
            return {**stats, **self._serve_new_adapter()}
        if not self._in_process:
            # The model crosses vLLM's serializer as host byte chunks (a tensor would arrive as
            # an untyped list; one byte string may not reach 4 GiB): fine for small models;
            # large ones should go through a group transport received on the worker side.
            payload = tensors_to_wire(named_tensors)
            self._warn_host_copy(wire_nbytes(payload))
        with self._engine_rpc() as llm:
            if self._in_process:
                stats = llm.collective_rpc("roll_ds_reload_weights", args=(named_tensors,))
            else:
                stats = llm.collective_rpc("roll_ds_reload_packed", args=(payload,))
            self._reset_kv_after_reload(llm)
        return stats[0]

    def _warn_host_copy(self, nbytes: int) -> None:
        """On GPU, a sync through this process copies the whole model through host memory
        (``host_copies``): say what that costs, once."""
        if getattr(self, "_host_copy_warned", False) or not current_platform().is_cuda:
            return
        if nbytes >= HOST_COPY_WARN_BYTES:
            self._host_copy_warned = True
            workers = self.tensor_parallel_size
            copies = host_copies(workers)
            logger.warning(
                "weight sync through the rollout actor (object_store): each sync serializes the "
                "%.2f GB model into vLLM's message to its engine process and on to %d vLLM "
                "worker(s), about %d host copies (%.2f GB) per engine per sync; "
                "weight_sync.transport=cuda_ipc (colocated) or collective (separate GPUs) move "
                "it GPU to GPU",
                nbytes / 1e9,
                workers,
                copies,
                nbytes * copies / 1e9,
            )

    # group transports: every vLLM worker is a member of the weight-sync group and receives
    # itself, through RollDsWorkerExtension (strategies/vllm/worker_ext.py)

    def transfer_group_devices(self) -> list[str | None]:
        """One member per vLLM worker (in TP-rank order): the UUID of the GPU it runs on
        (None on CPU)."""
        self._require_initialized()
        return self.llm.collective_rpc("roll_ds_device_uuid")

    def join_transfer_group(self, plane: str, seats: Sequence[Seat]) -> list[int]:
        """vLLM worker ``i`` joins ``seats[i]`` (blocks until every member of its group joins,
        bounded by the group's timeout); returns the ranks taken."""
        self._require_initialized()
        wire = seats_to_wire(seats)  # plain data: the seats may cross vLLM's serializer
        return self.llm.collective_rpc("roll_ds_join_transfer_group", args=(plane, wire))

    def receive_from_group(self, plane: str) -> dict[str, Any]:
        """The receiving side of a group sync: every vLLM worker reads one sync from the group
        it joined on ``plane`` into one reload, then the prefix cache is dropped (or, syncing
        the adapter, worker 0 writes it and the engine serves it). Returns worker 0's counts
        plus ``workers``."""
        self._require_awake("weights")
        adapter = None
        if self._adapters is not None:  # worker 0 writes the adapter directory
            adapter = adapter_to_wire(self._adapters.next_dir(), self._adapters.config)
        with self._engine_rpc() as llm:
            per_worker = llm.collective_rpc("roll_ds_receive_weights", args=(plane, adapter))
            if adapter is None:
                self._reset_kv_after_reload(llm)
        if adapter is not None:
            return {**per_worker[0], **self._serve_new_adapter(), "workers": len(per_worker)}
        return {**per_worker[0], "workers": len(per_worker)}

    def leave_transfer_group(self) -> None:
        """Every vLLM worker leaves its weight-sync group (if it joined one; no engine, no
        group)."""
        if self.llm is not None:
            self.llm.collective_rpc("roll_ds_leave_transfer_group")

    # adapter syncs (weight_sync.lora_sync: adapter)

    def enable_adapter_sync(self, config: Mapping[str, Any]) -> None:
        """From now on a sync carries the policy's LoRA adapter (peft names; ``config`` is its
        ``adapter_config.json``): it is written to a new version directory and served as a new
        LoRA on top of the base weights the engine loaded, replacing the previous one."""
        self._require_initialized()
        if self.adapter_rank is None:
            raise RuntimeError(
                "enable_adapter_sync: the engine was started without LoRA support; the role "
                "needs adapter_rank (StrategyContext.adapter_sync_rank) at construction"
            )
        if int(config.get("r", 0)) > vllm_lora_rank(self.adapter_rank):
            raise ValueError(
                f"adapter rank {config.get('r')} exceeds the engine's max_lora_rank "
                f"{vllm_lora_rank(self.adapter_rank)}"
            )
        if self._adapters is None:
            self._adapters = AdapterVersions(config)

    def _serve_new_adapter(self) -> dict[str, Any]:
        """Register the adapter just written to ``next_dir()`` with vLLM, retire the previous
        one. Returns ``adapter_version``."""
        from vllm.lora.request import LoRARequest

        versions = self._adapters
        version = versions.version + 1
        request = LoRARequest(f"{ADAPTER_LORA_NAME}_{version}", version, versions.next_dir())
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the synced adapter from {versions.next_dir()}")
        if self._lora_request is not None:
            engine.remove_lora(self._lora_request.lora_int_id)
        self._lora_request = request
        versions.commit()
        return {"adapter_version": version}
