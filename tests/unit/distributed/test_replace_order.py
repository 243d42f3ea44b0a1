"""A replacement rank starts only once the dead one is gone (``Cluster.replace_rank``,
``teardown.retire_ranks``): its process (``ray.kill`` only asks for it), the processes it
started (vLLM's engine core, SIGKILLed and waited for) and, on GPUs, their memory
(``devices.wait_released``: none of them on the GPU, free memory no longer rising).

Real processes: an "actor" that started a child, killed the way Ray does it (a moment after
being asked). The GPU is read at its boundary (``nvidia-smi``'s view, faked from the real
processes' state: they hold the GPU while they run, and the driver hands the memory back over
two readings after they ended).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from roll_ds.distributed import cluster as cluster_module
from roll_ds.distributed import devices
from roll_ds.distributed.cluster import Cluster
from roll_ds.distributed.devices import GpuUsage, wait_released
from roll_ds.distributed.shm import ShmLedger, descendants, end_and_wait, running, start_time

UUID = "3f2a0000-0000-0000-0000-000000000001"


def actor_with_a_child() -> tuple[subprocess.Popen, int]:
    actor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time\n"
            "child = subprocess.Popen(['sleep', '60'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    return actor, int(actor.stdout.readline())


class FakeGpu:
    """``gpu_usage`` of one GPU as the driver reports it: the given processes hold memory while
    they run; once all ended, the freed memory comes back over two readings."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.readings = pids, []
        self._returned = 0

    def __call__(self, uuids) -> dict[str, GpuUsage]:
        holding = frozenset(p for p in self.pids if running(p))
        if not holding and self._returned < 2:
            self._returned += 1
        usage = GpuUsage(free_mib=1000 + 50_000 * self._returned, pids=holding)
        self.readings.append(usage)
        return {u: usage for u in uuids}


@pytest.fixture
def processes():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_replacement_starts_after_the_dead_ranks_processes_and_gpu_memory_are_gone(
    monkeypatch, processes
):
    actor, child = actor_with_a_child()
    processes.append(actor)
    events: list[str] = []
    gpu = FakeGpu([actor.pid, child])
    monkeypatch.setattr(devices, "gpu_usage", gpu)
    monkeypatch.setattr(devices, "POLL_S", 0.05)

    def ray_kill(handle, no_restart):  # Ray's: asks the raylet, the process ends a bit later
        events.append("kill")
        threading.Timer(0.3, os.kill, (actor.pid, signal.SIGKILL)).start()

    monkeypatch.setattr(cluster_module.ray, "kill", ray_kill)

    cluster = Cluster.__new__(Cluster)  # one started rank, without Ray: the boundary is ray.kill
    cluster.name = "actor_infer"
    cluster.infos = [{"pid": actor.pid, "node_id": None, "gpu_uuids": (UUID,)}]
    cluster.children = {0: descendants(actor.pid)}
    assert list(cluster.children[0]) == [child]
    cluster.actors, cluster.shm, cluster._in_flight = ["old handle"], ShmLedger(), []
    cluster.placements, cluster._actor_options, cluster.incarnations = ["bundle"], {}, [0]
    cluster.start_timeout_s = 5.0
    cluster._start = (None, {}, None, (), {})
    seen_at_start = {}

    def new_actor(*args):
        events.append("start")
        seen_at_start.update(actor=running(actor.pid), child=running(child), gpu=list(gpu.readings))
        return SimpleNamespace(_roll_info=SimpleNamespace(remote=lambda: "ref"))

    cluster._new_actor = new_actor
    cluster._gather = lambda method, ranks, refs, timeout_s: [{"pid": 1}]

    cluster.replace_rank(0)

    assert events == ["kill", "start"]
    assert seen_at_start["actor"] is False and seen_at_start["child"] is False
    # the GPU is read once the processes are gone; the start waits for its memory to come back
    readings = seen_at_start["gpu"]
    assert [(r.free_mib, r.pids) for r in readings] == [(51_000, frozenset())] + [
        (101_000, frozenset())
    ] * 2
    assert cluster.incarnations == [1] and cluster.infos == [{"pid": 1}]


def test_the_ended_children_are_waited_for(processes):
    """``end_and_wait`` returns once the SIGKILLed processes are gone (a zombie counts as gone:
    it holds nothing, and its parent may never reap it)."""
    actor, child = actor_with_a_child()
    processes.append(actor)
    recorded = descendants(actor.pid)
    actor.kill()
    actor.wait()
    assert running(child, start_time(child))  # the orphan lives on
    killed, alive = end_and_wait(recorded, timeout_s=10.0)
    assert killed == [child] and alive == []
    assert not running(child)


def test_the_gpu_wait_is_bounded_and_says_so():
    def held(uuids):
        return {u: GpuUsage(free_mib=10, pids=frozenset({4242})) for u in uuids}

    started = time.monotonic()
    out = wait_released([UUID], [4242], 0.3, poll_s=0.05, read=held)
    assert out["released"] is False and out["free_mib"] == {UUID: 10}
    assert time.monotonic() - started < 1.0
    unreadable = wait_released([UUID], [4242], 5.0, read=lambda uuids: None)
    assert unreadable["released"] is None  # no driver tools (a CPU box): nothing to wait on
