"""Per-step seeds. A step's generation rounds and its PPO pass orders take their seeds from
``(seed, step, round)``, so a resumed run repeats them exactly."""

from __future__ import annotations


def step_seed(seed: int, step: int, round_: int) -> int:
    """The seed of generation round ``round_`` of step ``step`` (round 0 also seeds the
    step's pass orders)."""
    return (seed * 1_000_003 + step * 10_007 + round_ * 101) % (2**31 - 1)
