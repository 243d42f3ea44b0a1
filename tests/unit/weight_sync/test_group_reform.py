"""A weight-sync group left after a member died, and formed again without it
(``TransferGroup.close``, ``CollectiveTransport.close(dead=...)``; ``PolicySync`` re-forms the
group with the replacement engine).

On CPU the group is gloo and the dead member a forked process SIGKILLed after it joined: the
survivors' close does not wait on it, the sender's close frees a receiver still waiting in the
broken sync, and the same processes then form a new group with a new member. The NCCL path
(an abort, never a wait on the dead peer) runs where CUDA is (``gpu`` marker).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest
from _members import run_members

torch = pytest.importorskip("torch")

from roll_ds.weight_sync.base import TransferError  # noqa: E402
from roll_ds.weight_sync.collective import (  # noqa: E402
    BroadcastPlane,
    CollectiveTransport,
    ReceiveStream,
    receive_into,
    send_stream,
)
from roll_ds.weight_sync.group import GroupSpec, TransferGroup, open_store  # noqa: E402

BUCKETS = [[(f"w{i}", torch.full((256,), float(i)))] for i in range(4)]


# --- the close itself, at the process-group boundary ------------------------------------------


class FakeProcessGroup:
    def __init__(self, *methods: str, fails: bool = False) -> None:
        self.calls: list[str] = []
        for method in methods:
            setattr(self, method, lambda m=method: self._call(m, fails))

    def _call(self, method: str, fails: bool) -> None:
        self.calls.append(method)
        if fails:
            raise RuntimeError("already aborted")


def closed(pg: FakeProcessGroup) -> TransferGroup:
    group = TransferGroup.__new__(TransferGroup)  # no rendezvous: the pg is the boundary
    group.pg, group._store = pg, object()
    group.close()
    return group


def test_close_aborts_so_it_never_waits_on_a_peer():
    """NCCL's shutdown() finalizes (flushes pending work with every peer: a dead one hangs
    it); abort() does not. A backend without abort is shut down; a second close is a no-op."""
    pg = FakeProcessGroup("abort", "shutdown")
    group = closed(pg)
    assert pg.calls == ["abort"]
    assert group.pg is None and group._store is None
    group.close()
    assert pg.calls == ["abort"]
    old = FakeProcessGroup("shutdown")
    closed(old)
    assert old.calls == ["shutdown"]
    refuses = FakeProcessGroup("abort", fails=True)  # already aborted by a timed-out wait()
    closed(refuses)
    assert refuses.calls == ["abort"]


# --- the driver's close: the dead ranks are not called -----------------------------------------


class Calls:
    """A role whose ``submit`` records what was sent to which ranks."""

    def __init__(self, name: str, world_size: int, sent: list) -> None:
        self.name, self.world_size, self.sent = name, world_size, sent

    def submit(self, method: str, *args, _ranks=None):
        ranks = list(range(self.world_size)) if _ranks is None else list(_ranks)
        self.sent.append((self.name, method, ranks))
        return SimpleNamespace(ranks=ranks)


def closing(transport: CollectiveTransport, dead: list[int], world: int = 3):
    sent: list = []
    waited: dict = {}

    def wait(calls, deadline, bound=None, *, upstream=None):
        waited.update(calls=sorted(calls), seconds=deadline - time.monotonic())
        return {}

    transport._wait = wait
    transport.groups = {0: "a group"}
    transport.close(Calls("actor_train", 2, sent), Calls("actor_infer", world, sent), dead=dead)
    return sent, waited


def test_the_driver_leaves_without_the_dead_ranks_and_bounds_the_wait():
    transport = CollectiveTransport(bucket_bytes=1024, timeout_s=5.0, backend="gloo")
    sent, waited = closing(transport, dead=[1])
    assert sent == [
        ("actor_train", "weight_sync_leave", [0, 1]),
        ("actor_infer", "weight_sync_leave", [0, 2]),  # not rank 1: its seat died with it
    ]
    # a survivor may first wait out its broken receive (its own timeout_s), then leave
    assert 9.0 < waited["seconds"] <= 10.0
    assert transport.groups is None

    sent: list = []
    transport.close(Calls("actor_train", 2, sent), Calls("actor_infer", 3, sent), dead=[0])
    assert sent == []  # closed already: nothing to leave

    sent, waited = closing(CollectiveTransport(bucket_bytes=1, timeout_s=5.0), dead=[])
    assert [ranks for _, _, ranks in sent] == [[0, 1], [0, 1, 2]]
    assert 4.0 < waited["seconds"] <= 5.0  # nobody died: the close's own bound

    sent, waited = closing(CollectiveTransport(bucket_bytes=1, timeout_s=5.0), [0], world=1)
    assert sent == [("actor_train", "weight_sync_leave", [0, 1])]  # the only engine died
    assert waited["calls"] == ["actor_train"]


# --- a real gloo group with a member SIGKILLed -------------------------------------------------


def _doomed_member(spec: GroupSpec, rank: int, joined) -> None:
    """A forked member: joins, takes the first header, then waits to be killed."""
    group = TransferGroup(spec, rank, device="cpu")
    group.broadcast_object(None, "hello")
    joined.set()
    time.sleep(120)


def new_group(world: int, timeout_s: float, fork: dict[int, object] | None = None):
    """A group of ``world`` members on a fresh store: the ranks in ``fork`` are forked
    processes (``_doomed_member``), the others threads here. Returns (spec, groups, processes)."""
    store, host, port = open_store(timeout_s)
    spec = GroupSpec(host, port, world, "gloo", timeout_s, prefix=f"test/{time.monotonic_ns()}")
    ctx = multiprocessing.get_context("fork")
    processes = {}
    for rank, joined in (fork or {}).items():
        processes[rank] = ctx.Process(target=_doomed_member, args=(spec, rank, joined), daemon=True)
        processes[rank].start()
    threads = {
        r: (lambda r=r: TransferGroup(spec, r, device="cpu", store=store if r == 0 else None))
        for r in range(world)
        if r not in processes
    }
    groups = run_members(threads)
    assert all(isinstance(g, TransferGroup) for g in groups.values()), groups
    return spec, groups, processes


def test_a_member_killed_mid_sync_holds_up_no_close_and_the_rest_re_form():
    """Group ranks 0 (the sender), 1 (an engine, SIGKILLed after it joined) and 2 (a
    surviving engine). The sync fails on rank 0 at once (the dead peer's socket is closed);
    rank 2, waiting on rank 0, fails as soon as rank 0 leaves; neither close waits on the dead
    member. Then the sender and the survivor form a new group, on a new store, with a new
    member in the dead one's place, and a sync reaches both."""
    timeout_s = 20.0  # far above what any step below may take: a wait would show
    joined = multiprocessing.get_context("fork").Event()
    _, groups, processes = new_group(3, timeout_s, fork={1: joined})
    doomed = processes[1]
    try:
        survivor_got = {}

        def survivor():
            groups[2].broadcast_object(None, "hello")
            stream = ReceiveStream(groups[2], BroadcastPlane())
            try:
                receive_into(list, stream)
            except TransferError as exc:
                survivor_got["failed_at"] = time.monotonic()
                survivor_got["error"] = str(exc)
            started = time.monotonic()
            groups[2].close()
            survivor_got["close_s"] = time.monotonic() - started

        def sender():
            groups[0].broadcast_object("hello", "hello")
            assert joined.wait(30)
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.join(10)
            with pytest.raises(TransferError, match="rank 0/3"):
                send_stream(groups[0], iter(BUCKETS), BroadcastPlane())
            time.sleep(1.0)  # the survivor still waits: on rank 0, which has not left yet
            assert "failed_at" not in survivor_got
            started = time.monotonic()
            groups[0].close()
            return started, time.monotonic() - started

        out = run_members({0: sender, 2: survivor}, timeout_s=60)
        assert not isinstance(out[0], BaseException), out[0]
        assert not isinstance(out[2], BaseException), out[2]
        left_at, sender_close_s = out[0]
        assert sender_close_s < 1.0 and survivor_got["close_s"] < 1.0, (out, survivor_got)
        assert "rank 2/3" in survivor_got["error"], survivor_got
        freed_s = survivor_got["failed_at"] - left_at
        assert freed_s < 2.0, f"the survivor failed {freed_s:.2f} s after the sender left"

        # re-formed: the sender and the survivor (threads, as before) and a new member
        _, again, _ = new_group(3, timeout_s)

        def receive(rank: int) -> list:
            return receive_into(list, ReceiveStream(again[rank], BroadcastPlane()))

        received = run_members(
            {0: lambda: send_stream(again[0], iter(BUCKETS), BroadcastPlane())}
            | {r: (lambda r=r: receive(r)) for r in (1, 2)}
        )
        assert received[0]["buckets"] == len(BUCKETS), received
        for r in (1, 2):
            assert [float(t[0]) for _, t in received[r]] == [0.0, 1.0, 2.0, 3.0], received
        for group in again.values():
            group.close()
    finally:
        if doomed.is_alive():
            doomed.kill()
        for group in groups.values():
            group.close()
    print(f"\nsurvivor freed {freed_s:.3f} s after the sender left; closes {sender_close_s:.3f} s")


# --- NCCL (where CUDA is) ------------------------------------------------------------------------


def _nccl_spec(world: int, timeout_s: float) -> tuple[object, GroupSpec]:
    store, host, port = open_store(timeout_s)
    return store, GroupSpec(host, port, world, "nccl", timeout_s, prefix=f"t/{time.monotonic_ns()}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
def test_an_nccl_group_aborted_at_close_is_formed_again_in_the_same_process():
    """One GPU: a group closed (an abort: ``ncclCommAbort``) leaves the process able to join a
    new one on a fresh store, as a survivor does when the group is re-formed."""
    for value in (1.0, 2.0):
        store, spec = _nccl_spec(1, 30.0)
        group = TransferGroup(spec, 0, device="cuda:0", store=store)
        tensor = torch.full((8,), value, device="cuda:0")
        group.broadcast(tensor, "probe")
        assert group.broadcast_object({"v": value}, "header") == {"v": value}
        started = time.monotonic()
        group.close()
        assert time.monotonic() - started < 5.0


def _nccl_member(spec: GroupSpec, rank: int, joined) -> None:
    group = TransferGroup(spec, rank, device=f"cuda:{rank}")
    group.broadcast(torch.zeros(4, device=f"cuda:{rank}"), "hello")
    joined.set()
    time.sleep(300)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs; fewer are visible")
def test_an_nccl_peer_killed_mid_sync_fails_the_sync_in_bounded_time_and_close_does_not_wait():
    """Rank 1 (GPU 1) SIGKILLed after the group formed: rank 0's next broadcast fails within
    its timeout (blocking wait, ``group.py``), and its close (an abort) returns at once where
    a shutdown would finalize with the dead peer."""
    timeout_s = 10.0
    store, spec = _nccl_spec(2, timeout_s)
    ctx = multiprocessing.get_context("spawn")
    joined = ctx.Event()
    peer = ctx.Process(target=_nccl_member, args=(spec, 1, joined), daemon=True)
    peer.start()
    try:
        group = TransferGroup(spec, 0, device="cuda:0", store=store)
        group.broadcast(torch.zeros(4, device="cuda:0"), "hello")
        assert joined.wait(60)
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        started = time.monotonic()
        with pytest.raises(TransferError, match="rank 0/2"):
            group.broadcast(torch.ones(1 << 20, device="cuda:0"), "bucket 0")
        failed_s = time.monotonic() - started
        started = time.monotonic()
        group.close()
        close_s = time.monotonic() - started
    finally:
        if peer.is_alive():
            peer.kill()
    assert failed_s < timeout_s + 10.0, failed_s
    assert close_s < 5.0, close_s
    print(f"\nNCCL: the sync failed {failed_s:.2f} s after the kill; close took {close_s:.2f} s")
