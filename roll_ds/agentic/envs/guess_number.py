"""Guess the number: a multi-turn game where each move's feedback should shape the next.

    reset(seed)   "Guess a number 1-32."       (the secret: random.Random(seed) in [low, high])
    step("8")     "higher" / "lower"           the secret is higher / lower than the guess
    step("11")    "correct"                    reward 1.0, done, info {"success": True}
    step("hm")    "Reply with a number."       info {"format_error": True}, not done

The first integer in the policy's turn is its guess. Binary search finds any secret in
``ceil(log2(high - low + 2))`` guesses (6 for the default 1-32, which the embedded agent model
is warmed up for); counting up or ignoring the feedback does not, so the episode's success
measures whether the policy uses what it is told.
The runner bounds the turns (``max_actions_per_traj``); ``max_guesses`` bounds them here too
(the episode ends unsolved, reward 0), for use outside the runner. Observations are short: the
embedded agent model has 256 positions for the whole episode.
"""

from __future__ import annotations

import random
import re

from roll_ds.agentic.env import Env, StepResult

_INTEGER = re.compile(r"-?\d+")


class GuessNumberEnv(Env):
    def __init__(self, *, low: int = 1, high: int = 32, max_guesses: int | None = None) -> None:
        if low > high:
            raise ValueError(f"guess_number: low={low} must be <= high={high}")
        if max_guesses is not None and max_guesses < 1:
            raise ValueError(f"guess_number: max_guesses={max_guesses} must be >= 1 (or None)")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.guesses = 0
        return f"Guess a number {self.low}-{self.high}."

    def step(self, action: str) -> StepResult:
        if self.secret is None:
            raise RuntimeError("guess_number: step() before reset()")
        match = _INTEGER.search(action)
        if match is None:
            return StepResult("Reply with a number.", info={"format_error": True})
        guess = int(match.group())
        self.guesses += 1
        if guess == self.secret:
            return StepResult("correct", reward=1.0, done=True, info={"success": True})
        hint = "higher" if self.secret > guess else "lower"
        if self.max_guesses is not None and self.guesses >= self.max_guesses:
            return StepResult(f"{hint}; out of guesses", done=True, info={"success": False})
        return StepResult(hint)
