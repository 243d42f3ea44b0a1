"""The environment contract: Gym-like, text in and text out.

An environment is created from its ``env_config`` (keyword arguments), then

    observation = env.reset(seed)                  # the task: text or chat messages
    result = env.step(action_text)                 # the policy's turn, decoded
    result.observation, result.reward, result.done, result.info

``reset`` with the same seed gives the same episode, so a group of episodes sharing a seed is a
GRPO group. An observation is a string (sent as one ``user`` message) or a list of chat
messages (``{"role": "system" | "user" | "tool", "content": ...}``); the episode runner renders
it with the policy tokenizer's chat template. ``tools`` (JSON schemas in the OpenAI function
format) are passed to the chat template with the first observation.

``reward`` is the reward of this step (sum them for the episode's return); ``info`` may carry
``success`` (bool: the task is solved), ``tool_calls`` (int) and ``format_error`` /
``tool_error`` (bool) which the runner counts into metrics. Environments are plain Python and
run in environment workers off the driver; a step that raises or exceeds the step timeout ends
the episode with that status (``roll_ds/agentic/runner.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

Message = dict[str, str]
Observation = str | list[Message]


@dataclass
class StepResult:
    """What ``Env.step`` returns."""

    observation: Observation
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """Subclass, implement ``reset`` and ``step``, and register the class by name:

    ``ENVS.register("my_env")`` as a decorator, or a ``register_lazy`` line in
    ``roll_ds/agentic/registry.py``. The constructor takes the config's ``env_config`` as
    keyword arguments.
    """

    #: JSON schemas of the tools the policy may call (OpenAI function format), or empty
    tools: ClassVar[list[dict[str, Any]]] = []

    @abstractmethod
    def reset(self, seed: int) -> Observation:
        """Start the episode of ``seed``; returns the first observation."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the policy's turn (its decoded text, stop token excluded)."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Free what the environment holds."""


def as_messages(observation: Observation) -> list[Message]:
    """An observation as chat messages (a string is one ``user`` message)."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not isinstance(observation, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in observation
    ):
        raise TypeError(
            "an observation must be a string or a list of {'role', 'content'} messages, "
            f"got {observation!r:.200}"
        )
    return [dict(m) for m in observation]
