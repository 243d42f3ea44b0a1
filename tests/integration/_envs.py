"""Misbehaving environments for the environment-worker tests, importable by path
(``env_type: _envs:Sleepy``) in the workers' processes."""

from __future__ import annotations

import time

from roll_ds.agentic.env import Env, StepResult


class Sleepy(Env):
    """Each step sleeps ``seconds`` (forever on the action "hang") and ends the episode."""

    def __init__(self, seconds: float = 0.3) -> None:
        self.seconds = seconds

    def reset(self, seed):
        return f"seed {seed}"

    def step(self, action):
        time.sleep(3600 if action == "hang" else self.seconds)
        return StepResult("ok", reward=1.0, done=True)


class Crashing(Env):
    """Every step raises (the environment's own failure, not its host's)."""

    def reset(self, seed):
        return f"seed {seed}"

    def step(self, action):
        raise RuntimeError("this environment always fails")
