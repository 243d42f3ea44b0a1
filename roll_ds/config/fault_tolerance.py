"""What the driver does when a part of the run fails (``fault_tolerance`` in the config).

A trainer rank (``actor_train``, ``critic``) holds state no other process has: its ZeRO shard of
the weights and the optimizer. When one dies the run cannot go on in place; the driver tears down
every role, starts them again and resumes from the latest checkpoint exactly as a manual
``resume_from_checkpoint=latest`` does (``roll_ds/pipeline/restarts.py``). Read by the driver
only; importable without torch or Ray like the rest of ``roll_ds/config``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FaultToleranceConfig:
    """Automatic restarts of the run (``roll_ds/pipeline/restarts.py``)."""

    # Times the driver restarts the whole run from the latest checkpoint after a trainer rank
    # (actor_train, critic) dies or fails mid-run; 0: the first such failure stops the run.
    # A failure while the roles first start is never restarted (a config or environment problem).
    max_trainer_restarts: int = 2
