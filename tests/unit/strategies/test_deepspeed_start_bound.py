"""The trainer's start-up bound (strategies/deepspeed/start_bound.py) with stubs that block."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from strategies.deepspeed.start_bound import (
    START_TIMEOUT_ENV,
    StartTimeout,
    bounded_initialisation,
    start_timeout_s,
)


def block_forever() -> None:
    while True:  # a rendezvous waiting for a peer that never comes
        time.sleep(0.01)


def test_a_start_that_blocks_fails_naming_the_role_and_the_rank():
    aborted = []
    bound = bounded_initialisation(0.3, role="actor_train", rank=1, abort=lambda: aborted.append(1))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="actor_train rank 1: DeepSpeed") as info, bound:
        block_forever()
    assert time.monotonic() - start < 5
    assert START_TIMEOUT_ENV in str(info.value)
    assert aborted == [1]  # the default group is aborted so a blocked collective returns


def test_a_start_within_the_bound_is_left_alone():
    with bounded_initialisation(0.5, role="critic", rank=0):
        time.sleep(0.05)
    time.sleep(0.7)  # nothing lands after the block
    own = bounded_initialisation(5.0, role="critic", rank=0)
    with pytest.raises(ValueError, match="own"), own:
        raise ValueError("its own error")


def test_a_rank_stuck_past_the_grace_is_ended_with_the_message():
    """Stuck in C++: the exception cannot land, so the process is ended (here: a fake)."""
    ended: list[str] = []
    release = threading.Event()

    def exit_process(message: str) -> None:
        ended.append(message)
        release.set()

    bound = bounded_initialisation(
        0.2, role="critic", rank=2, grace_s=0.3, abort=lambda: None, exit_process=exit_process
    )
    with pytest.raises(TimeoutError, match="critic rank 2"), bound:
        while not release.is_set():
            # stands in for a C++ wait that the exception cannot interrupt
            with contextlib.suppress(StartTimeout):
                time.sleep(0.01)
    assert ended and "critic rank 2" in ended[0]


def test_the_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(START_TIMEOUT_ENV, "90")
    assert start_timeout_s() == 90.0
    monkeypatch.setenv(START_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=START_TIMEOUT_ENV):
        start_timeout_s()
