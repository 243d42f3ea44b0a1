"""A run's error category from how it ended (pure)."""

from __future__ import annotations

import signal

from roll_ds.sandbox.result import classify, last_exception


def test_last_exception_and_classify():
    tb = 'Traceback (most recent call last):\n  File "main.py", line 1\nMemoryError\n'
    assert last_exception(tb) == "MemoryError"
    assert last_exception("ValueError: bad\n") == "ValueError"
    assert last_exception("just text output\n") is None
    base = dict(stopped_for=None, exit_code=None, sig=None, cpu_s=0.1, cpu_limit_s=2, stderr="")
    assert classify(**{**base, "exit_code": 0}) == "ok"
    assert classify(**{**base, "stopped_for": "output_limit"}) == "output_limit"
    assert classify(**{**base, "sig": signal.SIGKILL, "cpu_s": 2.0}) == "timeout"
    assert classify(**{**base, "sig": signal.SIGSEGV}) == "runtime_error"
    assert classify(**{**base, "exit_code": 1, "stderr": tb}) == "memory"
    assert classify(**{**base, "exit_code": 1, "stderr": "IndentationError: x"}) == "syntax_error"
    fork = "BlockingIOError: [Errno 11] Resource temporarily unavailable"
    assert classify(**{**base, "exit_code": 1, "stderr": fork}) == "process_limit"
    assert classify(**{**base, "exit_code": 3}) == "runtime_error"
