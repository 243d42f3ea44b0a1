"""Environments, tool parsers and tools by name. Lazy ``"module:attr"`` entries, so a config's
names are checked without importing what they name.

Register your own with one line here, or with the decorators in your module::

    from roll_ds.agentic.registry import ENVS, TOOLS

    @ENVS.register("my_env")
    class MyEnv(Env): ...
"""

from __future__ import annotations

from roll_ds.registry import Registry

ENVS: Registry = Registry("environment")
ENVS.register_lazy("guess_number", "roll_ds.agentic.envs.guess_number:GuessNumberEnv")
ENVS.register_lazy("calculator", "roll_ds.agentic.envs.calculator:CalculatorEnv")

TOOL_PARSERS: Registry = Registry("tool parser")
TOOL_PARSERS.register_lazy("hermes", "roll_ds.agentic.parsers:parse_hermes")

TOOLS: Registry = Registry("tool")
TOOLS.register_lazy("calculator", "roll_ds.agentic.envs.calculator:CALCULATOR_TOOL")
TOOLS.register_lazy("python", "roll_ds.agentic.tools:PYTHON_TOOL")
