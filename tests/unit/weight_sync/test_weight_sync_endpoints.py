"""The workers' ends of a transport without Ray, DeepSpeed or vLLM: the registries, the workers'
dispatch modes, and a whole collective sync driven through the workers' weight-sync methods
(as ``CollectiveTransport`` calls them) over a real gloo group whose members are threads, into
a strategy that receives in the worker's process and into one whose engine workers receive."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _members import run_members

torch = pytest.importorskip("torch")

from roll_ds.distributed.dispatch import Dispatch, dispatch_spec  # noqa: E402
from roll_ds.weight_sync import PLANES, RECEIVERS, SENDERS, TRANSPORTS  # noqa: E402
from roll_ds.weight_sync.collective import (  # noqa: E402
    BroadcastPlane,
    CollectiveReceiver,
    CollectiveSender,
    CollectiveTransport,
    GroupMember,
    InProcessMember,
    group_seats,
)
from roll_ds.weight_sync.cuda_ipc import CudaIpcSender  # noqa: E402
from roll_ds.weight_sync.endpoint import (  # noqa: E402
    AdapterReceiver,
    EngineWorkersReceiver,
    WeightReceiver,
    receives_in_engine_workers,
)
from roll_ds.weight_sync.group import GroupSpec, open_store  # noqa: E402
from roll_ds.weight_sync.worker import ReceiverWorkerMixin, SenderWorkerMixin  # noqa: E402

TIMEOUT_S = 10.0


def buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(5, 3, generator=g)
    return [
        [("model.embed_tokens.weight", embed), ("lm_head.weight", embed)],
        [("model.norm.weight", torch.randn(3, generator=g))],
    ]


def all_ok(results: dict[int, Any]) -> dict[int, Any]:
    errors = {i: r for i, r in results.items() if isinstance(r, BaseException)}
    assert not errors, errors
    return results


# --- hand-written fakes at the strategy boundary ---------------------------------------------


class FakeSource:
    """A training strategy: hands out ``buckets()``, counting the ones walked."""

    def __init__(self, zero_stage: int = 3) -> None:
        self.zero_stage = zero_stage
        self.walked = 0
        self.asked: list[str] = []

    def _buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in buckets():
            self.walked += 1
            yield bucket

    def named_weights_for_sync(self, bucket_bytes: int) -> Iterator:
        self.asked.append("full")
        return self._buckets()

    def adapter_buckets_for_sync(self, bucket_bytes: int) -> Iterator:
        self.asked.append("adapter")
        return self._buckets()

    def adapter_config(self) -> dict[str, Any]:
        return {"r": 4}


class FakeRollout:
    """A rollout strategy that receives in its worker's process (``load_weights`` only)."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, named_tensors) -> dict[str, Any]:
        self.loaded = [(n, t.clone()) for n, t in named_tensors]
        return {"num_tensors": len(self.loaded)}


class FakeEngine(FakeRollout):
    """A rollout strategy whose engine workers (threads here, vLLM's workers in the product)
    join the group and receive themselves."""

    receives_in_engine_workers = True

    def __init__(self, workers: int = 2) -> None:
        super().__init__()
        self.seats = [GroupMember() for _ in range(workers)]
        self.per_worker: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(workers)]

    def load_weights(self, named_tensors) -> dict[str, Any]:
        raise AssertionError("a group sync must reach the engine workers, not this process")

    def transfer_group_devices(self) -> list[str | None]:
        return [None] * len(self.seats)

    def join_transfer_group(self, plane: str, seats) -> list[int]:
        def join(i):
            spec, rank = seats[i]
            self.seats[i].join(spec, rank, plane, device="cpu")
            return rank

        out = all_ok(run_members({i: lambda i=i: join(i) for i in range(len(self.seats))}))
        return [out[i] for i in range(len(self.seats))]

    def receive_from_group(self, plane: str) -> dict[str, Any]:
        def receive(i):
            def load(named):
                self.per_worker[i] = [(n, t.clone()) for n, t in named]
                return {"num_tensors": len(self.per_worker[i])}

            return self.seats[i].receive(load, plane)

        out = all_ok(run_members({i: lambda i=i: receive(i) for i in range(len(self.seats))}))
        return {**out[0], "workers": len(out)}

    def leave_transfer_group(self) -> None:
        for seat in self.seats:
            seat.leave()


class TrainRank(SenderWorkerMixin):
    def __init__(self, strategy: FakeSource, rank: int = 0) -> None:
        self.strategy, self.rank, self.local_rank = strategy, rank, 0


class RolloutRank(ReceiverWorkerMixin):
    def __init__(self, strategy: FakeRollout, rank: int = 0) -> None:
        self.strategy, self.rank, self.local_rank = strategy, rank, 0


# --- registries and imports ------------------------------------------------------------------


def test_every_transport_registers_a_sender_and_a_receiver():
    assert SENDERS.names() == RECEIVERS.names() == TRANSPORTS.names()
    for name in TRANSPORTS:
        assert SENDERS.get(name).name == RECEIVERS.get(name).name == name
    assert PLANES.names() == ["broadcast", "cuda_ipc"]
    assert PLANES.get("broadcast") is BroadcastPlane
    with pytest.raises(ValueError, match="unknown weight-sync data plane 'rdma'; valid: broadcast"):
        PLANES.get("rdma")


def test_collective_chooses_planes_by_registry_not_by_importing_cuda_ipc():
    code = (
        "import sys, roll_ds.weight_sync.worker, roll_ds.weight_sync.collective\n"
        "print('roll_ds.weight_sync.cuda_ipc' in sys.modules,\n"
        "      [m for m in ('torch', 'ray', 'vllm') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False []"


def test_workers_keep_their_dispatch_modes():
    from roll_ds.pipeline.workers import ActorTrainWorker, RolloutWorker

    train = {
        "publish_weights": Dispatch.ALL,
        "adapter_config": Dispatch.RANK0,
        "weight_sync_open": Dispatch.ALL,
        "weight_sync_join": Dispatch.ALL,
        "weight_sync_leave": Dispatch.ALL,
    }
    rollout = {
        "receive_weights": Dispatch.ALL,
        "enable_adapter_sync": Dispatch.ALL,
        "weight_sync_members": Dispatch.ALL,
        "weight_sync_join": Dispatch.ALL,
        "weight_sync_leave": Dispatch.ALL,
    }
    assert {m: dispatch_spec(ActorTrainWorker, m).mode for m in train} == train
    assert {m: dispatch_spec(RolloutWorker, m).mode for m in rollout} == rollout
    assert not hasattr(RolloutWorker, "_is_vllm")


# --- what strategies declare -----------------------------------------------------------------


def test_receivers_pick_the_path_by_what_the_strategy_declares():
    local, engine = FakeRollout(), FakeEngine()
    assert isinstance(local, WeightReceiver) and not isinstance(local, AdapterReceiver)
    assert isinstance(engine, EngineWorkersReceiver)
    assert not receives_in_engine_workers(local) and receives_in_engine_workers(engine)
    assert isinstance(CollectiveReceiver(local, device="cpu").members, InProcessMember)
    assert CollectiveReceiver(engine, device="cpu").members is engine
    assert CollectiveReceiver(engine, device="cpu").member_devices() == [None, None]
    assert CollectiveReceiver(local, device="cpu").member_devices() == [None]  # CPU: no GPU


def test_vllm_strategy_declares_engine_worker_receiving():
    pytest.importorskip("vllm")
    from strategies.vllm import VllmStrategy

    strategy = VllmStrategy(model_path="/m")
    assert isinstance(strategy, EngineWorkersReceiver) and isinstance(strategy, AdapterReceiver)
    assert receives_in_engine_workers(strategy)
    strategy.leave_transfer_group()  # no engine yet: no group to leave


def test_adapter_sync_needs_a_strategy_that_serves_adapters():
    with pytest.raises(ValueError, match="FakeRollout rollout strategy cannot serve a LoRA"):
        RolloutRank(FakeRollout()).enable_adapter_sync({"r": 4})


# --- a whole sync through the workers' methods -----------------------------------------------


def connect(train: TrainRank, infer: RolloutRank, transport: str = "collective") -> list[int]:
    """What ``CollectiveTransport.connect`` asks of the workers (one rollout rank, train rank 0
    sending to all its members)."""
    devices = [infer.weight_sync_members(transport)]
    plan = CollectiveTransport.plan([], devices)
    host, port = train.weight_sync_open(transport, TIMEOUT_S, sorted(plan))
    prefix = f"test/{time.monotonic_ns()}"
    specs = {0: GroupSpec(host, port, 1 + len(devices[0]), "gloo", TIMEOUT_S, prefix)}
    seats = group_seats(plan, specs, [len(devices[0])])
    out = all_ok(
        run_members(
            {
                0: lambda: train.weight_sync_join(transport, specs),
                1: lambda: infer.weight_sync_join(transport, seats),
            }
        )
    )
    return out[1]


@pytest.mark.parametrize("strategy_cls", [FakeRollout, FakeEngine])
def test_a_collective_sync_through_the_workers_methods(strategy_cls):
    source, strategy = FakeSource(), strategy_cls()
    train, infer = TrainRank(source), RolloutRank(strategy)
    ranks = connect(train, infer)
    assert ranks == ([1, 2] if strategy_cls is FakeEngine else [1])
    out = all_ok(
        run_members(
            {
                0: lambda: train.publish_weights("collective", 1 << 20, rollout_dtype="bf16"),
                1: lambda: infer.receive_weights("collective"),
            }
        )
    )
    sent, received = out[0], out[1]
    assert sent["buckets"] == 2 and sent["num_tensors"] == 3
    assert sent["gather_seconds"] == pytest.approx(sent["seconds"] - sent["transfer_seconds"])
    assert received["received_buckets"] == 2 and received["num_tensors"] == 3
    assert received["seconds"] > 0
    expected = [(n, t.to(torch.bfloat16)) for b in buckets() for n, t in b]  # cast before sending
    loaded = strategy.per_worker if strategy_cls is FakeEngine else [strategy.loaded]
    for got in loaded:
        assert [n for n, _ in got] == [n for n, _ in expected]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))
    train.weight_sync_leave()
    infer.weight_sync_leave()
    assert train.weight_sender is None and infer.weight_receiver is None


@pytest.mark.parametrize(("zero_stage", "walked"), [(3, 2), (2, 0)])
def test_other_train_ranks_send_nothing_but_join_zero3_gathers(zero_stage, walked):
    source = FakeSource(zero_stage)
    assert TrainRank(source, rank=1).publish_weights("collective", 1 << 20) is None
    assert source.walked == walked
    assert TrainRank(source, rank=1).weight_sync_open("collective", TIMEOUT_S) is None
    TrainRank(source, rank=1).weight_sync_join("collective", {})  # no group of its own


@pytest.mark.parametrize(("zero_stage", "walked"), [(3, 2), (2, 1)])
def test_a_sender_whose_group_broke_still_joins_the_rest_of_the_zero3_gathers(zero_stage, walked):
    """An engine died mid-sync: the send fails in the group after the first bucket, and under
    ZeRO-3 the sender walks the other buckets (the other ranks gather them with it) before the
    error surfaces; under ZeRO 0-2 nothing is gathered together."""
    from roll_ds.weight_sync.base import TransferError

    class BrokenGroup(CollectiveSender):
        def send(self, buckets):
            next(iter(buckets))
            raise TransferError("weight-sync group rank 0/3: bucket 0 failed")

    source = FakeSource(zero_stage)
    train = TrainRank(source)
    train.weight_sender = BrokenGroup(device="cpu")
    with pytest.raises(TransferError, match="bucket 0 failed"):
        train.publish_weights("collective", 1 << 20)
    assert source.walked == walked


def test_a_second_train_rank_sends_to_its_own_group():
    """cuda_ipc's shape with the broadcast plane on CPU: train rank 1 is a sender (senders=(1,))
    and streams the same buckets to the member paired with it."""
    source, strategy = FakeSource(zero_stage=2), FakeEngine(workers=1)
    train, infer = TrainRank(source, rank=1), RolloutRank(strategy)
    host, port = train.weight_sync_open("collective", TIMEOUT_S, [1])
    specs = {1: GroupSpec(host, port, 2, "gloo", TIMEOUT_S, f"test/{time.monotonic_ns()}")}
    seats = group_seats({1: [(0, 0)]}, specs, [1])
    all_ok(
        run_members(
            {
                0: lambda: train.weight_sync_join("collective", specs),
                1: lambda: infer.weight_sync_join("collective", seats),
            }
        )
    )
    out = all_ok(
        run_members(
            {
                0: lambda: train.publish_weights("collective", 1 << 20, senders=(1,)),
                1: lambda: infer.receive_weights("collective"),
            }
        )
    )
    assert out[0]["buckets"] == 2 and out[1]["received_buckets"] == 2
    assert [n for n, _ in strategy.per_worker[0]] == [n for b in buckets() for n, _ in b]
    train.weight_sync_leave()
    infer.weight_sync_leave()


def test_group_seats_give_each_member_its_sender_group_and_name_the_unserved():
    specs = {r: GroupSpec("h", 1, 3, "gloo", 1.0, f"p/{r}") for r in (0, 1)}
    seats = group_seats({0: [(0, 0), (1, 0)], 1: [(0, 1), (1, 1)]}, specs, [2, 2])
    assert seats == [[(specs[0], 1), (specs[1], 1)], [(specs[0], 2), (specs[1], 2)]]
    with pytest.raises(
        ValueError, match=r"no train rank sends to \(rollout rank, member\) \[\(1, 0\)\]"
    ):
        group_seats({0: [(0, 0)]}, specs, [1, 1])


def test_adapter_only_publishes_the_adapter_buckets():
    source = FakeSource(zero_stage=2)
    TrainRank(source, rank=1).publish_weights("collective", 1 << 20, adapter_only=True)
    assert source.asked == ["adapter"]
    assert TrainRank(source).adapter_config() == {"r": 4}


def test_group_calls_out_of_order_or_on_the_wrong_transport_fail_clearly():
    train = TrainRank(FakeSource())
    with pytest.raises(RuntimeError, match="joined no weight-sync group"):
        train.publish_weights("collective", 1 << 20)
    spec = GroupSpec("127.0.0.1", 1, 2, "gloo", 1.0, "test/x")
    with pytest.raises(RuntimeError, match="weight_sync_join before weight_sync_open"):
        train.weight_sync_join("collective", {0: spec})
    with pytest.raises(ValueError, match="'object_store' builds no group"):
        train.weight_sync_open("object_store", 1.0)
    with pytest.raises(ValueError, match="unknown weight-sync receiver 'rdma'; valid: collective"):
        RolloutRank(FakeRollout()).receive_weights("rdma")


def test_a_call_naming_another_transport_replaces_the_held_end():
    train = TrainRank(FakeSource())
    train.weight_sync_open("collective", TIMEOUT_S)
    first = train.weight_sender
    assert isinstance(first, CollectiveSender) and first._store is not None
    train._sender("cuda_ipc")
    assert first._store is None  # closed
    assert isinstance(train.weight_sender, CudaIpcSender)


def test_a_member_checks_the_plane_it_joined_by():
    store, host, port = open_store(TIMEOUT_S)
    member = GroupMember()
    with pytest.raises(RuntimeError, match="joined no weight-sync group"):
        member.receive(list, "broadcast")
    spec = GroupSpec(host, port, 1, "gloo", TIMEOUT_S, f"test/{time.monotonic_ns()}")
    member.join(spec, 0, "broadcast", device="cpu", store=store)
    with pytest.raises(RuntimeError, match="asked to receive by 'cuda_ipc'; the group was joined"):
        member.receive(list, "cuda_ipc")
    member.leave()
    assert member.group is None and member.plane is None
