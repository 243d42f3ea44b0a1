"""Code that runs inside vLLM's worker (``worker_extension_cls``): checked in-place weight reload.

``VllmStrategy`` names ``RollDsWorkerExtension`` in ``vllm.LLM(worker_extension_cls=...)``; vLLM
then mixes it into its worker class, so ``llm.collective_rpc("roll_ds_reload_weights", ...)``
runs on every tensor-parallel worker, in whatever process that worker lives (the caller's own
process on CPU, where the engine is in-process; else a process of its own, see "Arguments"). The
group transports (``collective``, ``cuda_ipc``) receive on the worker side: each worker takes a
seat in the weight-sync group (``roll_ds.weight_sync.collective.GroupMember``, which also checks
the plane and drains the stream after a failed load) and feeds the received tensors to
``reload_weights_checked`` as *one* iterator; ``VllmStrategy``'s ``*_transfer_group`` /
``receive_from_group`` methods call these ``roll_ds_*`` methods on every worker.

Two ways a reload can go silently wrong, both closed here:

- A model with tied embeddings needs ``lm_head.weight`` in the iterator: without it vLLM logs
  "ParallelLMHead: Failed to load weights" and keeps serving the old output head (on CPU the head
  holds its own repacked copy). ``with_tied_lm_head`` adds the alias whenever it is missing.
- vLLM's layer-wise reload only *logs* layers that received no weights (and keeps their old
  tensors). ``reload_weights_checked`` turns those warnings into an error. A consequence: every
  call must carry the full model. Reloading bucket by bucket in separate calls would either fail
  this check or, for a layer split across buckets, process it half-loaded.

Arguments. Where the engine core is a separate process (GPU; CPU with ``ROLL_DS_VLLM_MULTIPROC=1``)
every argument crosses vLLM's msgpack serializer and arrives untyped (a dataclass as a dict, a
tensor as a list): the strategy sends plain data only (``roll_ds.weight_sync.wire``), and these
methods rebuild the typed objects (``seat_from_wire``, ``tensors_from_wire``).

Memory. What a sync allocates on the GPU here lies outside vLLM's memory budget (the group
transports' receive buckets, copies out of CUDA IPC buffers, the reload's materialised layer):
every ``roll_ds_*`` method that reloads empties torch's CUDA cache when it ends
(``releases_cached_memory``), so the worker's reserved memory returns to its level before the
sync.

Importing this module must not import vLLM (it is also used by pure unit tests).
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from roll_ds.weight_sync.adapter import write_adapter
from roll_ds.weight_sync.wire import seat_from_wire, tensors_from_wire

if TYPE_CHECKING:
    import torch

    from roll_ds.weight_sync.collective import GroupMember

EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"

RELOAD_LOGGER = "vllm.model_executor.model_loader"
FAILURE_MARKERS = ("Failed to load weights", "weights were not loaded")

T = TypeVar("T")
logger = logging.getLogger(__name__)


def with_tied_lm_head(
    named_tensors: Iterable[tuple[str, torch.Tensor]], tied: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``(name, tensor)`` through; with ``tied``, follow the input embedding with the same
    tensor as ``lm_head.weight`` unless the caller already sent that name (then a later explicit
    ``lm_head.weight`` is dropped, so the head is loaded exactly once)."""
    head_sent = False
    for name, tensor in named_tensors:
        if name == LM_HEAD_NAME:
            if tied and head_sent:
                continue
            head_sent = True
        yield name, tensor
        if tied and name == EMBED_NAME and not head_sent:
            head_sent = True
            yield LM_HEAD_NAME, tensor


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def captured_load_warnings(logger_name: str = RELOAD_LOGGER) -> Iterator[list[str]]:
    """Collect WARNING+ messages vLLM's loader logs meanwhile (even if vLLM's log level is
    set above WARNING: the logger's own level is lowered for the duration)."""
    logger = logging.getLogger(logger_name)
    handler = _Collect()
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def load_failures(messages: Iterable[str], param_owners: set[str]) -> list[str]:
    """The messages that report weights left unloaded. A "<Layer>: Failed to load weights" about
    a layer class that owns no parameters (rotary embeddings: only a cos/sin buffer computed at
    start-up) is benign, as vLLM then keeps the buffer it computed."""
    failures = []
    for message in messages:
        if not any(marker in message for marker in FAILURE_MARKERS):
            continue
        layer, sep, _ = message.partition(": Failed to load weights")
        if sep and layer not in param_owners:
            continue
        failures.append(message)
    return failures


def parameter_owners(model: torch.nn.Module) -> set[str]:
    """Class names of the modules that hold parameters themselves."""
    return {
        type(m).__name__
        for m in model.modules()
        if next(m.parameters(recurse=False), None) is not None
    }


def reload_weights_checked(
    worker: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, Any]:
    """Reload ``worker``'s model in place from HF-named tensors (checkpoint format: unfused
    q/k/v, gate/up), through vLLM's layer-wise reload path, which also redoes the CPU kernels'
    weight repacking. Raises if any layer was left with its old weights."""
    tied = tie_word_embeddings(worker)
    count, nbytes = 0, 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count, nbytes
        for name, tensor in with_tied_lm_head(named_tensors, tied):
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    start = time.perf_counter()
    # Worker.reload_weights is model_runner.reload_weights under the worker's vLLM config context.
    reload = getattr(worker, "reload_weights", None) or worker.model_runner.reload_weights
    with captured_load_warnings() as messages:
        try:
            reload(weights_iterator=counted())
        except BaseException:
            try:
                abandon_reload(worker)
            except Exception:  # the stream's error is the one to report
                logger.exception("could not finish vLLM's interrupted weight reload")
            raise
    failures = load_failures(messages, parameter_owners(worker.model_runner.get_model()))
    if failures:
        raise RuntimeError(
            "vLLM weight reload left layers with their old weights (the iterator must carry "
            f"every weight of the model, under HF names): {'; '.join(failures)}"
        )
    return {
        "num_tensors": count,
        "bytes": nbytes,
        "seconds": time.perf_counter() - start,
        "tied_lm_head": tied,
    }


def abandon_reload(worker: Any) -> None:
    """After a reload whose weights stopped coming half-way (a group sync broke: the sender or
    another engine died), finish vLLM's layer-wise reload so the next one can start: it left
    the layers it had not completed on the meta device with wrapped loaders, which the next
    reload skips setting up and then fails in (measured: "'Parameter' object has no attribute
    'weight_loader'"). Finishing puts the old weights back in the layers that got none and
    processes the others with what they got, so the engine serves a mix of old and new
    weights until the sync is redone (``PolicySync`` redoes it in full)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    config = getattr(worker, "vllm_config", None) or runner.vllm_config
    with set_current_vllm_config(config):
        finalize_layerwise_reload(runner.get_model(), config.model_config)


def model_runner_problems(runner: Any) -> list[str]:
    """What ``runner`` lacks of what this extension calls on vLLM's model runner
    (``reload_weights(weights_iterator=...)``, ``get_model()``; on an instance also
    ``model_config.hf_config``), named after its class; empty when it has everything. vLLM's
    workers build one of two runner classes, V1 or Model Runner V2
    (``strategies.vllm.start.MODEL_RUNNERS``), and roll_ds needs the same from both."""
    cls = runner if isinstance(runner, type) else type(runner)
    name = f"{cls.__module__}.{cls.__qualname__}"
    problems = []
    reload = getattr(runner, "reload_weights", None)
    if not callable(reload):
        problems.append(f"{name}.reload_weights")
    elif "weights_iterator" not in _parameter_names(reload):
        problems.append(f"{name}.reload_weights(weights_iterator=...)")
    if not callable(getattr(runner, "get_model", None)):
        problems.append(f"{name}.get_model()")
    hf_config = getattr(getattr(runner, "model_config", None), "hf_config", None)
    if not isinstance(runner, type) and hf_config is None:  # an instance's attribute
        problems.append(f"{name}.model_config.hf_config")
    return problems


def _parameter_names(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature to read
        return set()


def tie_word_embeddings(worker: Any) -> bool:
    hf_config = worker.model_runner.model_config.hf_config
    text_config = (
        hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    )
    return bool(getattr(text_config, "tie_word_embeddings", False))


def _ignore(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {}


def release_cached_memory(device: Any) -> None:
    """Give the GPU back what torch's caching allocator holds free in this worker. A sync
    allocates outside vLLM's memory budget (a collective's receive buckets, the copies out of
    CUDA IPC buffers, the layer-wise reload's materialised layer): freed after it but, without
    this, kept reserved by this process while vLLM sizes or wakes its KV cache. Off CUDA a
    no-op."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def releases_cached_memory(method: Callable[..., T]) -> Callable[..., T]:
    """A worker-extension method after which (returning or raising) ``release_cached_memory``
    runs on the worker's device."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        finally:
            release_cached_memory(getattr(self, "device", "cpu"))

    return wrapper


class RollDsWorkerExtension:
    """Mixed into vLLM's worker class; every name starts with ``roll_ds_`` (``_roll_ds_`` when
    private) so it cannot clash with the worker's own attributes (vLLM asserts there is no
    clash)."""

    @releases_cached_memory
    def roll_ds_reload_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """In-process engines only: the caller's iterator, handed over as is."""
        return reload_weights_checked(self, named_tensors)

    @releases_cached_memory
    def roll_ds_reload_packed(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A whole model as plain data (``roll_ds.weight_sync.wire.tensors_to_wire``): what
        crosses vLLM's process boundary."""
        return reload_weights_checked(self, tensors_from_wire(payload))

    def roll_ds_tie_word_embeddings(self) -> bool:
        return tie_word_embeddings(self)

    def roll_ds_model_runner(self) -> dict[str, Any]:
        """The class of this worker's model runner (vLLM picks V1 or Model Runner V2 when the
        engine starts) and what it lacks of what this extension calls on it."""
        runner = self.model_runner
        cls = type(runner)
        return {
            "runner": f"{cls.__module__}.{cls.__qualname__}",
            "problems": model_runner_problems(runner),
        }

    def roll_ds_eager_token_ranks(self) -> bool:
        """On CPU: vLLM's sampler counts token ranks eagerly (``cpu_sampler``: its compiled
        count costs every engine's first request 3-4 s of torch.compile)."""
        from strategies.vllm.cpu_sampler import eager_token_ranks

        return eager_token_ranks()

    def roll_ds_device_memory(self) -> dict[str, int]:
        """This worker's torch allocator figures on its GPU, in bytes (``allocated``,
        ``reserved``; zeros on CPU): what a sync leaves behind shows here."""
        import torch

        device = torch.device(getattr(self, "device", "cpu"))
        if device.type != "cuda":
            return {"allocated": 0, "reserved": 0}
        return {
            "allocated": int(torch.cuda.memory_allocated(device)),
            "reserved": int(torch.cuda.memory_reserved(device)),
        }

    # weight-sync group (roll_ds.weight_sync.collective / cuda_ipc): this worker is one member,
    # its seat a roll_ds.weight_sync.collective.GroupMember

    _roll_ds_member: GroupMember | None = None

    def roll_ds_worker_rank(self) -> int:
        """This worker's rank in its engine (tensor-parallel rank)."""
        return int(getattr(self, "rank", 0))

    def roll_ds_device_uuid(self) -> str | None:
        """The UUID of the GPU this worker runs on (None on CPU): ``cuda_ipc`` pairs it with
        the train rank on the same GPU."""
        from roll_ds.distributed.devices import uuid_of

        return uuid_of(getattr(self, "device", "cpu"))

    def roll_ds_join_transfer_group(self, plane: str, seats: list[dict[str, Any]]) -> int:
        """Join ``seats[own rank]`` (``wire.seats_to_wire``: a group and this worker's rank in
        it; blocks until every member joins, bounded by the group's timeout); a previous group
        is left first."""
        spec, rank = seat_from_wire(seats[self.roll_ds_worker_rank()])
        self._roll_ds_seat().join(spec, rank, plane, device=getattr(self, "device", "cpu"))
        return rank

    @releases_cached_memory
    def roll_ds_receive_weights(
        self, plane: str, adapter: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Receive one sync from the group and reload the whole model from it in one pass.
        ``adapter`` (``weight_sync.lora_sync: adapter``; ``wire.adapter_to_wire``): the sync
        carries a LoRA adapter; worker 0 writes it to ``adapter["directory"]`` with
        ``adapter["config"]`` (the others drain the stream), and the strategy then registers
        it with the engine."""
        if adapter is None:
            sink = functools.partial(reload_weights_checked, self)
        elif self.roll_ds_worker_rank() == 0:
            sink = functools.partial(
                write_adapter, directory=adapter["directory"], config=adapter["config"]
            )
        else:
            sink = _ignore  # the stream is drained
        return self._roll_ds_seat().receive(sink, plane)

    def roll_ds_leave_transfer_group(self) -> None:
        self._roll_ds_seat().leave()

    def _roll_ds_seat(self) -> GroupMember:
        if self._roll_ds_member is None:
            from roll_ds.weight_sync.collective import GroupMember

            self._roll_ds_member = GroupMember()
        return self._roll_ds_member
