"""A test hook that makes one trainer rank stop answering in the middle of a step, the way a rank
stuck in a collective does (the other ranks then wait for it in the step's all-reduce).

    ROLL_DS_TEST_HANG_TRAIN_STEP=<rank>:<marker file>

Inert unless that variable is set (in a role's ``system_envs``). Rank ``<rank>`` of the role
sleeps forever at the start of its next ``train_step``, once per marker file: it creates the file
first, so the rank of a restarted run finds it and trains (a restart can then finish the run).
What it shows: the call's bound (``fault_tolerance.call_timeout_s``) ends the wait, names the
ranks, and the driver restarts the run (``tests/integration/test_rlvr_pipeline.py``).
"""

from __future__ import annotations

import logging
import os
import time

ENV = "ROLL_DS_TEST_HANG_TRAIN_STEP"
logger = logging.getLogger(__name__)


def armed(env: str, at: int) -> bool:
    """Whether the test hook ``env`` (``<n>:<marker file>``, unset: inert) fires at ``at``: its
    ``n`` is ``at`` and this call creates the marker (once per marker: the replacement or the
    restarted run that counts to ``n`` again finds it and goes on)."""
    spec = os.environ.get(env)
    if not spec:
        return False
    target, _, marker = spec.partition(":")
    if not marker:
        raise ValueError(f"{env}={spec!r}: expected <n>:<marker file>")
    if int(target) != at:
        return False
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False  # this marker's fault happened already
    return True


def hang_if_asked(rank: int) -> None:
    """Sleep forever when ``ENV`` names ``rank`` and its marker file does not exist yet."""
    if not armed(ENV, rank):
        return
    logger.warning("%s: rank %d stops answering in this train step (a test hook)", ENV, rank)
    while True:
        time.sleep(3600)
