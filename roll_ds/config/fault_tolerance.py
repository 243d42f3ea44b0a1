"""The ``fault_tolerance`` section: what a run does when a worker dies or stops answering.

Stateless roles (the rollout engines, the reference, the reward roles) are replaced in place
(``roll_ds/distributed/recovery.py``): a new actor on the dead one's placement bundle, brought
up as at start (the engines also get the current weights, parity checked), and the call it
had in flight is sent again. The agentic environment hosts are replaced by their pool and
their episodes played again (``roll_ds/agentic/env_pool.py``). ``max_restarts`` bounds that
per role over the run.

A trainer rank (``actor_train``, ``critic``) holds state no other process has: its ZeRO shard of
the weights and the optimizer. When one dies the run cannot go on in place; the driver tears down
every role, starts them again and resumes from the latest checkpoint exactly as a manual
``resume_from_checkpoint=latest`` does (``roll_ds/pipeline/restarts.py``), at most
``max_trainer_restarts`` times.

Every actor call waits at most ``call_timeout_s`` plus what scales with its work (a generate
call: ``per_token_s`` per token it may produce or read); a call past its bound is a stuck worker,
treated as a dead one (``WorkerTimeoutError`` naming the ranks; replaced or restarted as above).
The defaults are generous so a slow, shared CPU box never trips them; they exist so a stuck
rank ends the wait instead of hanging the run forever.

Importable without torch or Ray (``roll_ds/config/``'s rule).
"""

from __future__ import annotations

from dataclasses import dataclass

# The roles a run can replace in place: they hold no state a step builds up (the engines'
# weights come back with a full sync; the reference's and the reward models' never change).
# actor_train and critic hold optimizer state: a dead trainer restarts the run instead.
STATELESS_ROLES = ("actor_infer", "reference")
REWARD_ROLE_PREFIX = "rewards."


def is_stateless(role: str) -> bool:
    """Whether ``role`` (a cluster name) can be replaced in place."""
    return role in STATELESS_ROLES or role.startswith(REWARD_ROLE_PREFIX)


@dataclass
class FaultToleranceConfig:
    """Replacing dead stateless workers, restarting the run after a trainer dies, and the bound
    of every wait on an actor."""

    # Replacements of dead or stuck workers allowed per stateless role over the whole run
    # (actor_infer, reference, each rewards.<name>, the agentic environment hosts); 0: a dead
    # worker stops the run.
    max_restarts: int = 3
    # Times the driver restarts the whole run from the latest checkpoint after a trainer rank
    # (actor_train, critic) dies or fails mid-run; 0: the first such failure stops the run.
    # A failure while the roles first start is never restarted (a config or environment problem).
    max_trainer_restarts: int = 2
    # The bound of any actor call not scaled by its work (scoring, log-probs, a train step,
    # a checkpoint save), in seconds; generous: a slow CPU box never reaches it. A role's
    # initialize waits at least 300 s (start-up) whatever this is.
    call_timeout_s: float = 3600.0
    # A generate call waits call_timeout_s plus this per token each engine may handle (its
    # prompts' tokens plus max_new_tokens per sample), in seconds.
    per_token_s: float = 0.05
    # The trainers' (DeepSpeed's) process-group timeout, in seconds: a rank waiting longer in
    # one collective is ended by torch's watchdog (the run restarts). While train rank 0 waits
    # up to weight_sync.timeout_s on an engine in a sync, the other ranks wait for it in the
    # next bucket's ZeRO-3 gather: this must exceed that bound by a margin (validated), or an
    # engine that hangs turns its replacement into a trainer restart. DeepSpeed's default: 600.
    process_group_timeout_s: float = 1800.0
    # A resume on another data-parallel size converts the checkpoint first (DeepSpeed: a
    # universal checkpoint, in the driver before the trainers start); that conversion may take
    # 300 s plus the checkpoint's bytes at this many MiB per second (100 GB: about 85 min).
    convert_min_mib_per_s: float = 20.0
