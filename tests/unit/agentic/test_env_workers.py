"""``EnvHost``'s worker threads: kept between steps, a hung call answered at its deadline and its
thread replaced, errors returned as data."""

from __future__ import annotations

import threading
import time

from roll_ds.agentic.env_pool import ERROR, OK, TIMEOUT, _Workers


def test_threads_are_reused_between_batches():
    workers = _Workers()
    before = threading.active_count()
    for _ in range(5):
        results = workers.run_all([lambda i=i: i * i for i in range(8)], timeout_s=5.0)
        assert [r[:2] for r in results] == [(OK, i * i) for i in range(8)]
    assert threading.active_count() - before <= 8  # one batch's worth, not five


def test_a_hung_call_times_out_alone_and_its_thread_is_replaced():
    workers = _Workers()
    release = threading.Event()

    def hang():
        release.wait(30)
        return "late"

    def boom():
        raise ValueError("environment bug")

    started = time.perf_counter()
    results = workers.run_all([hang, lambda: "ok", boom], timeout_s=0.3)
    assert time.perf_counter() - started < 2.0
    assert results[0][0] == TIMEOUT and "step_timeout_s=0.3" in results[0][1]
    assert results[1][:2] == (OK, "ok")
    assert results[2][0] == ERROR and "environment bug" in results[2][1]
    # the hung thread is still busy: the next batch gets threads of its own and runs at once
    again = workers.run_all([lambda: 1, lambda: 2, lambda: 3], timeout_s=1.0)
    assert [r[:2] for r in again] == [(OK, 1), (OK, 2), (OK, 3)]
    release.set()
