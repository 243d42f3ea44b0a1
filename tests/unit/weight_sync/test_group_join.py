"""Joining the weight-sync group connects, inside join's bound (``TransferGroup``,
``rendezvous``): the members meet on the store, the backend is built, NCCL's communicator is
initialised at once and a barrier passed; a member that never joins fails the join naming
it, never the first sync.

``ProcessGroupNCCL`` connects lazily (in its first collective) unless told to connect: on CPU
its boundary is a fake backend recording what the join asks of it; gloo runs for real. What a
GPU shows: scripts/gpu/check.py ``nccl`` and tests/unit/weight_sync/test_group_reform.py (gpu).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _members import run_members

torch = pytest.importorskip("torch")

from roll_ds.weight_sync import group as group_module  # noqa: E402
from roll_ds.weight_sync.base import TransferError  # noqa: E402
from roll_ds.weight_sync.group import GroupSpec, TransferGroup, open_store  # noqa: E402


class Done:
    def wait(self) -> bool:
        return True


class FakeNccl:
    """ProcessGroupNCCL at its boundary: records the calls; collectives complete at once."""

    def __init__(self, rank: int, calls: list) -> None:
        self.rank, self.calls = rank, calls

    def eager_connect_single_device(self, device: Any) -> None:
        self.calls.append((self.rank, "connect", str(device)))

    def allreduce(self, tensors: list) -> Done:
        self.calls.append((self.rank, "allreduce", tensors[0].numel()))
        return Done()

    def abort(self) -> None:
        self.calls.append((self.rank, "abort"))


def spec_of(world: int, backend: str, timeout_s: float) -> tuple[Any, GroupSpec]:
    store, host, port = open_store(timeout_s)
    return store, GroupSpec(
        host, port, world, backend, timeout_s, prefix=f"j/{time.monotonic_ns()}"
    )


@pytest.fixture
def fake_nccl(monkeypatch):
    calls: list = []
    built: list[int] = []

    def backend(spec, store, rank, device):
        built.append(rank)
        return FakeNccl(rank, calls)

    monkeypatch.setattr(group_module, "_backend", backend)
    return calls, built


def join_all(store: Any, spec: GroupSpec, ranks, timeout_s: float = 30) -> dict[int, Any]:
    def join(rank: int) -> TransferGroup:
        return TransferGroup(spec, rank, device="cpu", store=store if rank == 0 else None)

    return run_members({r: (lambda r=r: join(r)) for r in ranks}, timeout_s=timeout_s)


def test_an_nccl_join_connects_the_communicator_and_passes_a_barrier(fake_nccl):
    calls, built = fake_nccl
    store, spec = spec_of(2, "nccl", 10.0)
    groups = join_all(store, spec, (0, 1))
    assert all(isinstance(g, TransferGroup) for g in groups.values()), groups
    for rank in (0, 1):  # before join returned: the connect, then the barrier's all-reduce
        assert [c for c in calls if c[0] == rank] == [
            (rank, "connect", "cpu"),
            (rank, "allreduce", 1),
        ]
    assert sorted(built) == [0, 1]


def test_an_nccl_member_that_never_joins_fails_the_join_in_its_bound_naming_it(fake_nccl):
    """Rank 2 never comes: ranks 0 and 1 fail their join after timeout_s, naming rank 2, and
    no backend was built (its communicator init would wait for rank 2 without a bound)."""
    calls, built = fake_nccl
    timeout_s = 1.5
    store, spec = spec_of(3, "nccl", timeout_s)
    started = time.monotonic()
    out = join_all(store, spec, (0, 1))
    elapsed = time.monotonic() - started
    for rank in (0, 1):
        assert isinstance(out[rank], TransferError), out
        assert f"(rank {rank} of 3): rank(s) [2] did not join within 1.5 s" in str(out[rank])
    assert built == [] and calls == []
    assert timeout_s <= elapsed < timeout_s + 3.0, elapsed


def test_a_gloo_member_that_never_joins_fails_the_join_naming_it():
    timeout_s = 1.5
    store, spec = spec_of(3, "gloo", timeout_s)
    started = time.monotonic()
    out = join_all(store, spec, (0, 2))
    elapsed = time.monotonic() - started
    for rank in (0, 2):
        assert isinstance(out[rank], TransferError), out
        assert "rank(s) [1] did not join within 1.5 s" in str(out[rank]), out
    assert elapsed < timeout_s + 3.0, elapsed
