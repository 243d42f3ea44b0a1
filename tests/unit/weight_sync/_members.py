"""Run the members of a process group as threads of one test process."""

from __future__ import annotations

import threading
from typing import Any


def run_members(fns: dict[int, Any], timeout_s: float = 30) -> dict[int, Any]:
    """Run ``fns[rank]()`` in threads; returns each result or the exception it raised."""
    results: dict[int, Any] = {}

    def run(rank, fn):
        try:
            results[rank] = fn()
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a member hung"
    return results
