"""Tools declared with a JSON schema, and ``ToolEnv``: a task the policy solves by calling them.

A ``Tool`` is a name, a description, a JSON schema of its arguments (the OpenAI function format
the chat templates take as ``tools=``) and a function ``(arguments) -> str``. ``ToolEnv`` runs
the turn loop every tool task shares:

    the policy's text -> parser -> tool calls?  yes: run each (validated against its schema),
                                                     the results are the next observation
                                                no:  the text is the final answer -> score it

A malformed call (bad JSON, an unknown tool, arguments that fail the schema, a tool that
raises) becomes an error observation the model sees and is counted in ``info`` (``tool_error``
/ ``format_error``); the run goes on. Subclasses implement ``task(seed)`` and ``score(answer)``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from roll_ds.agentic.env import Env, Observation, StepResult
from roll_ds.agentic.parsers import ParsedTurn, ToolCall


@dataclass(frozen=True)
class Tool:
    """A tool; its schema is checked once, here (a bad one: ``ValueError`` naming the tool),
    and its validator built once and kept for every call."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[[dict[str, Any]], str]
    _validator: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cls = jsonschema.validators.validator_for(self.parameters)
        try:
            cls.check_schema(self.parameters)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "(top level)"
            raise ValueError(
                f"tool '{self.name}': its parameters are not a valid JSON schema "
                f"({cls.__name__}): at {where}: {exc.message}"
            ) from None
        object.__setattr__(self, "_validator", cls(self.parameters))

    def schema(self) -> dict[str, Any]:
        """The OpenAI function form chat templates take (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def argument_error(self, arguments: dict[str, Any]) -> str | None:
        """Why ``arguments`` do not fit the schema (the error ``jsonschema.validate`` would
        raise), or None."""
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(arguments))
        return None if error is None else f"tool '{self.name}': bad arguments: {error.message}"

    def __call__(self, call: ToolCall) -> tuple[str, str | None]:
        """``(output, error)``: the tool's output, or an error message the model sees."""
        error = self.argument_error(call.arguments)
        if error:
            return error, error
        try:
            return str(self.fn(call.arguments)), None
        except Exception as exc:  # a tool failure is an observation, not a crash
            message = f"tool '{self.name}' failed: {type(exc).__name__}: {exc}"
            return message, message


class ToolEnv(Env):
    """A task with tools. ``max_tool_calls`` bounds calls per episode (past it, a call is an
    error observation); the episode ends at the first turn without a tool call (the answer)."""

    def __init__(
        self,
        *,
        tools: Sequence[Tool],
        parser: str = "hermes",
        max_tool_calls: int = 4,
        tool_error_reward: float = 0.0,
    ) -> None:
        from roll_ds.agentic.registry import TOOL_PARSERS

        self._tools = {t.name: t for t in tools}
        self.tools = [t.schema() for t in tools]  # type: ignore[misc]  (per instance)
        self.parse: Callable[[str], ParsedTurn] = TOOL_PARSERS.get(parser)
        self.max_tool_calls = max_tool_calls
        self.tool_error_reward = tool_error_reward
        self.calls_made = 0

    @abstractmethod
    def task(self, seed: int) -> Observation:
        """The episode's task (first observation) for ``seed``."""

    @abstractmethod
    def score(self, answer: str) -> float:
        """The final answer's reward (1.0 solves the task)."""

    def reset(self, seed: int) -> Observation:
        self.calls_made = 0
        return self.task(seed)

    def step(self, action: str) -> StepResult:
        turn = self.parse(action)
        if not turn.has_calls:
            reward = self.score(turn.content)
            info = {"success": reward >= 1.0, "tool_calls": 0}
            return StepResult(observation=[], reward=reward, done=True, info=info)
        outputs, errors = [], list(turn.errors)
        made_before = self.calls_made
        for call in turn.calls:
            if self.calls_made >= self.max_tool_calls:
                errors.append(f"too many tool calls (max {self.max_tool_calls})")
                break
            self.calls_made += 1
            tool = self._tools.get(call.name)
            if tool is None:
                known = ", ".join(sorted(self._tools))
                errors.append(f"unknown tool '{call.name}'; available: {known}")
                continue
            output, error = tool(call)
            if error:  # the error is the output: one message, not two
                errors.append(error)
            else:
                outputs.append(output)
        messages = [{"role": "tool", "content": text} for text in [*outputs, *errors]]
        info = {  # calls made: those past max_tool_calls were refused, not run
            "tool_calls": self.calls_made - made_before,
            "tool_calls_refused": len(turn.calls) - (self.calls_made - made_before),
            "tool_error": bool(errors),
            "format_error": bool(turn.errors),
        }
        reward = self.tool_error_reward if errors else 0.0
        return StepResult(observation=messages, reward=reward, done=False, info=info)


_SANDBOX: Any = None  # one per process, probed on first use


def _run_python(arguments: dict[str, Any]) -> str:
    """The ``python`` tool: run ``code`` in the code sandbox (``network_isolation:
    required``: where the kernel cannot isolate, the tool fails and says why); stdout, or the
    error the model sees."""
    global _SANDBOX
    from roll_ds.sandbox import Sandbox

    if _SANDBOX is None:
        _SANDBOX = Sandbox()
    result = _SANDBOX.run(arguments["code"])
    if result.category == "ok":
        return result.stdout.strip()
    return f"error ({result.category}): {result.stderr.strip()[-300:]}"


PYTHON_TOOL = Tool(
    name="python",
    description="Run a Python program in a sandbox and return what it prints.",
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    fn=_run_python,
)
