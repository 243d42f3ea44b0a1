"""Every payload the vLLM strategy sends its engine workers, round-tripped through vLLM's own
serializer as on GPU, then rebuilt by the worker extension.

Where the engine core is a separate process (GPU; CPU with ROLL_DS_VLLM_MULTIPROC=1),
``llm.collective_rpc(method, args=...)`` becomes a utility call: the client's ``MsgpackEncoder``
encodes ``(client, call_id, "collective_rpc", (method, timeout, args, kwargs))``, the engine core
decodes it untyped (``MsgpackDecoder()``) and converts only ``msgspec.Struct`` arguments
(``EngineCoreProc._convert_msgspec_args``); the result comes back as a ``UtilityResult`` inside
``EngineCoreOutputs``. ``BoundaryLLM`` does exactly that around a fake worker that is the real
``RollDsWorkerExtension``, so the strategy's own methods are what is tested.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.engine import EngineCoreOutputs, UtilityOutput  # noqa: E402
from vllm.v1.engine.core import EngineCore, EngineCoreProc  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult  # noqa: E402

from roll_ds.weight_sync.group import GroupSpec  # noqa: E402
from roll_ds.weight_sync.wire import tensors_to_wire  # noqa: E402
from strategies.vllm import VllmStrategy  # noqa: E402
from strategies.vllm.worker_ext import RollDsWorkerExtension  # noqa: E402


def across_the_boundary(method: str, args: tuple) -> tuple:
    """``args`` as the engine core hands them to ``EngineCore.collective_rpc``'s workers."""
    frames = MsgpackEncoder().encode((0, 7, "collective_rpc", (method, None, args, None)))
    _, _, name, core_args = MsgpackDecoder().decode(frames)
    assert name == "collective_rpc"
    convert = EngineCoreProc._convert_msgspec_args
    core_args = convert(EngineCore.collective_rpc, tuple(core_args))
    got_method, _, got_args, _ = core_args
    assert got_method == method
    return tuple(got_args)


def result_back(result: Any) -> Any:
    """A worker's result as the client receives it (EngineCoreOutputs.utility_output)."""
    out = EngineCoreOutputs(utility_output=UtilityOutput(7, result=UtilityResult(result)))
    back = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))
    return back.utility_output.result.result


class FakeMember:
    """Stands in for the worker's weight-sync seat: records the join, streams given tensors."""

    def __init__(self, tensors: list[tuple[str, Any]]) -> None:
        self.tensors = tensors
        self.joined: tuple | None = None

    def join(self, spec, rank, plane, *, device) -> None:
        self.joined = (spec, rank, plane)

    def receive(self, load, plane):
        return load(iter(self.tensors)) or {}

    def leave(self) -> None:
        self.joined = None


class FakeWorker(RollDsWorkerExtension):
    """A vLLM worker with the roll_ds extension: records what its reload receives."""

    def __init__(self, rank: int = 0) -> None:
        self.rank, self.device = rank, "cpu"
        self.loaded: list[tuple[str, Any]] = []
        hf_config = SimpleNamespace(tie_word_embeddings=False)
        self.model_runner = SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf_config),
            get_model=lambda: torch.nn.Module(),
            reload_weights=self._reload,
        )

    def _reload(self, weights_iterator) -> None:
        self.loaded = [(n, t.clone()) for n, t in weights_iterator]


class BoundaryLLM:
    """``vllm.LLM`` as the strategy sees it on GPU: each call crosses vLLM's serializer."""

    def __init__(self, workers: list[FakeWorker]) -> None:
        self.workers = workers
        self.calls: list[str] = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.calls.append(method)
        crossed = across_the_boundary(method, args)
        return [result_back(getattr(w, method)(*crossed)) for w in self.workers]

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return True


def strategy_over(workers: list[FakeWorker]) -> VllmStrategy:
    strategy = VllmStrategy(model_path="unused")
    strategy.llm = BoundaryLLM(workers)
    strategy._in_process = False  # the engine core is another process
    return strategy


SPEC = GroupSpec(
    host="10.0.0.3", port=29511, world_size=3, backend="nccl", timeout_s=90.0, prefix="p/0"
)


def model_tensors() -> list[tuple[str, Any]]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(16, 8, generator=g)
    return [
        ("model.embed_tokens.weight", embed),
        ("lm_head.weight", embed),  # tied: the same tensor under two names
        ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),  # < 256 B
        ("model.layers.0.mlp.up_proj.weight", torch.randn(32, 8, generator=g)),  # side frame
        ("model.rotary.inv_freq", torch.arange(4, dtype=torch.int64)),
        ("empty", torch.empty(0, 3)),
    ]


def test_a_group_spec_crosses_as_a_plain_dict():
    """What the issue found: the dataclass arrives as a dict and a tuple as a list."""
    (seats,) = across_the_boundary("m", ([(SPEC, 1)],))
    assert seats == [[dict(vars(SPEC)), 1]]


def test_a_tensor_crosses_as_an_untyped_list():
    (small, large) = across_the_boundary("m", (torch.ones(2, 3), torch.ones(64, 64)))
    assert small[:2] == ["float32", [2, 3]] and not isinstance(small, torch.Tensor)
    assert large[:2] == ["float32", [64, 64]] and isinstance(large[2], int)  # data: lost


def test_join_seats_arrive_as_group_specs_on_every_tp_worker():
    workers = [FakeWorker(rank=0), FakeWorker(rank=1)]
    members = [FakeMember([]), FakeMember([])]
    for worker, member in zip(workers, members, strict=True):
        worker._roll_ds_member = member
    other = GroupSpec("10.0.0.4", 29600, 2, "nccl", 90.0, "p/1")
    ranks = strategy_over(workers).join_transfer_group("cuda_ipc", [(SPEC, 1), (other, 1)])
    assert ranks == [1, 1]
    assert members[0].joined == (SPEC, 1, "cuda_ipc")
    assert members[1].joined == (other, 1, "cuda_ipc")
    assert isinstance(members[0].joined[0], GroupSpec)


@pytest.mark.parametrize("tp", [1, 2])
def test_load_weights_rebuilds_every_tensor_on_the_worker(tp):
    """object_store on GPU: the whole model reaches every worker, dtype and shape intact."""
    workers = [FakeWorker(rank=r) for r in range(tp)]
    strategy = strategy_over(workers)
    sent = model_tensors()
    stats = strategy.load_weights(iter(sent))
    assert stats["num_tensors"] == len(sent)
    assert strategy.llm.calls == ["roll_ds_reload_packed"]
    for worker in workers:
        assert [n for n, _ in worker.loaded] == [n for n, _ in sent]
        for (_, got), (_, want) in zip(worker.loaded, sent, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)


def test_a_group_receive_of_full_weights_returns_plain_stats():
    worker = FakeWorker()
    worker._roll_ds_member = FakeMember(model_tensors()[:1])
    out = strategy_over([worker]).receive_from_group("broadcast")
    assert out["num_tensors"] == 1 and out["workers"] == 1
    assert worker.loaded[0][0] == "model.embed_tokens.weight"


def test_an_adapter_receive_writes_where_the_strategy_said(tmp_path):
    from roll_ds.weight_sync.adapter import ADAPTER_CONFIG, AdapterVersions

    worker = FakeWorker()
    adapter = [("base_model.model.q_proj.lora_A.weight", torch.randn(4, 8))]
    worker._roll_ds_member = FakeMember(adapter)
    strategy = strategy_over([worker])
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    strategy._adapters = AdapterVersions(config, root=str(tmp_path))
    strategy._serve_new_adapter = lambda: {"adapter_version": 1}
    out = strategy.receive_from_group("broadcast")
    assert out["num_tensors"] == 1
    written = os.path.join(str(tmp_path), "v000001")
    with open(os.path.join(written, ADAPTER_CONFIG)) as f:
        assert json.load(f) == config


def test_the_workers_answers_cross_back_unchanged():
    worker = FakeWorker()
    strategy = strategy_over([worker])
    assert strategy.transfer_group_devices() == [None]
    stats = {"num_tensors": 3, "bytes": 12, "seconds": 0.5, "tied_lm_head": True}
    assert result_back(stats) == stats
    assert result_back("GPU-1234") == "GPU-1234"


# --- a model of 4 GiB and more: byte chunks under the limit -------------------------------


def byte_string_lengths(frames) -> list[int]:
    """The length of every byte string inside an encoded message's main frame."""
    import msgspec

    lengths: list[int] = []

    def walk(obj) -> None:
        if isinstance(obj, bytes | bytearray | memoryview):
            lengths.append(len(obj))
        elif isinstance(obj, list | tuple):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item)

    walk(msgspec.msgpack.decode(frames[0]))
    return lengths


class RecordingLLM(BoundaryLLM):
    """``BoundaryLLM`` that also keeps each call's encoded frames."""

    def __init__(self, workers: list[FakeWorker]) -> None:
        super().__init__(workers)
        self.frames: list = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.frames.append(
            MsgpackEncoder().encode((0, 7, "collective_rpc", (method, None, args, None)))
        )
        return super().collective_rpc(method, args)


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_cross_in_chunks_under_the_limit_and_arrive_identical(monkeypatch, tp):
    """The limit lowered to 64 bytes: every tensor over it is split, no byte string in vLLM's
    message is longer, and every worker rebuilds the same tensors (dtype, shape, bits)."""
    from roll_ds.weight_sync import wire

    monkeypatch.setattr(wire, "WIRE_CHUNK_BYTES", 64)
    workers = [FakeWorker(rank=r) for r in range(tp)]
    strategy = strategy_over(workers)
    strategy.llm = RecordingLLM(workers)
    sent = model_tensors()
    strategy.load_weights(iter(sent))
    (frames,) = strategy.llm.frames
    lengths = byte_string_lengths(frames)
    assert max(lengths) <= 64
    total = sum(t.numel() * t.element_size() for t in {id(t): t for _, t in sent}.values())
    assert sum(lengths) == total  # the tied head crossed once
    for worker in workers:
        assert [n for n, _ in worker.loaded] == [n for n, _ in sent]
        for (_, got), (_, want) in zip(worker.loaded, sent, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)


def test_a_tensor_split_over_chunks_is_joined_and_aliases_stay_one_tensor():
    from roll_ds.weight_sync.wire import tensors_from_wire, tensors_to_wire

    embed = torch.randn(16, 8)  # 512 bytes: 8 chunks of 64
    payload = tensors_to_wire([("e", embed), ("head", embed), ("b", torch.ones(3))], 64)
    assert [t["chunks"] for t in payload["tensors"]] == [[0, 8], [8, 9]]
    (crossed,) = across_the_boundary("m", (payload,))
    got = dict(tensors_from_wire(crossed))
    assert torch.equal(got["e"], embed) and got["head"] is got["e"]
    assert torch.equal(got["b"], torch.ones(3))


GIB4 = 2**32  # msgspec's bin 32 holds at most 2**32 - 1 bytes


def lazy_zeros(nbytes: int) -> torch.Tensor:
    """A host tensor of ``nbytes`` zeros whose pages are not touched (numpy's calloc), so a
    4 GiB one costs no memory until written."""
    import numpy as np

    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))


def test_vllms_encoder_refuses_a_byte_string_of_4_gib():
    """What one byte buffer for the whole model (the earlier wire format) met at 4 GiB."""
    import msgspec

    data = memoryview(lazy_zeros(GIB4).numpy())
    with pytest.raises(msgspec.EncodeError, match="longer than 2"):
        MsgpackEncoder().encode((0, 7, "collective_rpc", ("m", None, ({"data": data},), None)))


def test_a_tensor_of_4_gib_goes_out_as_views_under_the_limit():
    """With the real limit: no chunk reaches it, and the chunks view the tensor (no copy)."""
    from roll_ds.weight_sync.wire import MSGPACK_BIN_MAX, WIRE_CHUNK_BYTES, tensors_to_wire

    assert WIRE_CHUNK_BYTES < 2**31 <= MSGPACK_BIN_MAX
    big = lazy_zeros(GIB4 + 16)
    payload = tensors_to_wire([("model.embed_tokens.weight", big)])
    lengths = [len(c) for c in payload["chunks"]]
    assert max(lengths) <= WIRE_CHUNK_BYTES and sum(lengths) == GIB4 + 16
    assert len(lengths) == -(-(GIB4 + 16) // WIRE_CHUNK_BYTES)
    first = torch.frombuffer(payload["chunks"][0], dtype=torch.uint8)
    assert first.data_ptr() == big.data_ptr()  # a view, not a copy


# --- after a sync the worker gives its cached GPU memory back -----------------------------


class EventMember(FakeMember):
    def __init__(self, tensors, events: list[str]) -> None:
        super().__init__(tensors)
        self.events = events

    def receive(self, load, plane):
        out = super().receive(load, plane)
        self.events.append("received")
        return out


@pytest.fixture
def cache_events(monkeypatch) -> list[str]:
    """Calls of ``torch.cuda.empty_cache`` (the boundary: no GPU here) recorded in order."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    return events


@pytest.mark.parametrize("sync", ["group", "packed"])
def test_a_sync_on_a_gpu_worker_ends_by_emptying_the_cuda_cache(cache_events, sync):
    worker = FakeWorker()
    worker.device = torch.device("cuda", 0)
    worker._roll_ds_member = EventMember(model_tensors()[:1], cache_events)
    strategy = strategy_over([worker])
    if sync == "group":
        strategy.receive_from_group("broadcast")
        assert cache_events == ["received", "empty_cache"]  # after the buckets are freed
    else:
        strategy.load_weights(iter(model_tensors()))
        assert cache_events == ["empty_cache"]


def test_a_failed_reload_still_empties_the_cuda_cache(cache_events):
    worker = FakeWorker()
    worker.device = torch.device("cuda", 0)

    def fail(weights_iterator):
        raise RuntimeError("reload failed")

    worker.model_runner.reload_weights = fail
    with pytest.raises(RuntimeError, match="reload failed"):
        worker.roll_ds_reload_packed(across_the_boundary("m", (tensors_to_wire([]),))[0])
    assert cache_events == ["empty_cache"]


def test_a_cpu_worker_leaves_the_cache_alone(cache_events):
    worker = FakeWorker()
    worker._roll_ds_member = EventMember(model_tensors()[:1], cache_events)
    strategy_over([worker]).receive_from_group("broadcast")
    assert cache_events == ["received"]
    assert worker.roll_ds_device_memory() == {"allocated": 0, "reserved": 0}


def test_tensors_made_and_dropped_one_by_one_each_cross_as_themselves():
    """A streaming iterator (the object store's buckets) drops each tensor once yielded: a
    later tensor may then reuse an earlier one's ``id``, which must not make it an alias."""
    from roll_ds.weight_sync.wire import tensors_from_wire, tensors_to_wire

    def stream():
        for i in range(1, 40):
            yield f"w{i}", torch.full((i % 7 + 1, 3), float(i))

    (crossed,) = across_the_boundary("m", (tensors_to_wire(stream()),))
    for name, got in tensors_from_wire(crossed):
        i = int(name[1:])
        assert torch.equal(got, torch.full((i % 7 + 1, 3), float(i))), name


@pytest.mark.parametrize(("tp", "copies"), [(1, 3), (2, 9)])
def test_a_large_sync_on_a_gpu_says_its_host_copies_once(monkeypatch, caplog, tp, copies):
    import logging

    from roll_ds.platform import CUDA, use_platform
    from strategies.vllm import weight_sync

    monkeypatch.setattr(weight_sync, "HOST_COPY_WARN_BYTES", 64)
    workers = [FakeWorker(rank=r) for r in range(tp)]
    strategy = strategy_over(workers)
    strategy.tensor_parallel_size = tp
    previous = use_platform(CUDA)
    try:
        with caplog.at_level(logging.WARNING, logger=weight_sync.__name__):
            strategy.load_weights(iter(model_tensors()))
            strategy.load_weights(iter(model_tensors()))
    finally:
        use_platform(previous)
    (record,) = caplog.records
    assert f"about {copies} host copies" in record.getMessage()
