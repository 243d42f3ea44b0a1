"""A test hook that SIGKILLs an environment host in the middle of a rollout, the way the OOM
killer or a lost node ends one.

    ROLL_DS_TEST_KILL_ENV_HOST=<n>:<marker file>

Inert unless that variable is set (in the run's environment: the hosts, Ray workers started by
the run, inherit it). A host process sends itself SIGKILL at the start of its ``n``-th
``step`` call, once per marker file: it creates the file first, so its replacement (which
counts from 1 again) steps on. ``n`` picks the moment (the host's first calls are step 0's
evaluation when ``eval_steps`` is set). What it shows: the pool replaces the host and the
runner plays its episodes again (``tests/integration/test_agentic_pipeline.py``).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal

from roll_ds.distributed.hang_hook import armed

ENV = "ROLL_DS_TEST_KILL_ENV_HOST"
logger = logging.getLogger(__name__)
_calls = itertools.count(1)  # this process's step calls (a host serves one call at a time)


def kill_if_asked() -> None:
    """SIGKILL this process when ``ENV`` names this step call and its marker does not exist."""
    if not armed(ENV, next(_calls)):
        return
    logger.warning("%s: this environment host SIGKILLs itself (a test hook)", ENV)
    os.kill(os.getpid(), signal.SIGKILL)
