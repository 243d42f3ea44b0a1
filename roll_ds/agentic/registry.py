"""Environments, tool parsers and tools by name. Lazy ``"module:attr"`` entries, so a config's
names are checked without importing what they name.

Register your own with one line here, or with the decorators in your module::

    from roll_ds.agentic.registry import ENVS, TOOLS

    @ENVS.register("my_env")
    class MyEnv(Env): ...

or name it by import path in the config (``env_type: my_package.envs:MyEnv``): environment
workers run in their own processes, where only importable names resolve.
"""

from __future__ import annotations

from roll_ds.registry import Registry, find_path_problem, is_import_path

ENVS: Registry = Registry("environment")
ENVS.register_lazy("guess_number", "roll_ds.agentic.envs.guess_number:GuessNumberEnv")
ENVS.register_lazy("calculator", "roll_ds.agentic.envs.calculator:CalculatorEnv")

TOOL_PARSERS: Registry = Registry("tool parser")
TOOL_PARSERS.register_lazy("hermes", "roll_ds.agentic.parsers:parse_hermes")

TOOLS: Registry = Registry("tool")
TOOLS.register_lazy("calculator", "roll_ds.agentic.envs.calculator:CALCULATOR_TOOL")
TOOLS.register_lazy("python", "roll_ds.agentic.tools:PYTHON_TOOL")


def env_class(env_type: str) -> type:
    """The environment class a config's ``env_type`` names: a registered name or an import
    path ``module:Class`` (``Registry.resolve``)."""
    return ENVS.resolve(env_type)


def env_type_problem(env_type: str) -> str | None:
    """Why ``env_type`` names no environment, or None (an import path is checked by finding
    its module, without importing it: environment workers import it in their processes)."""
    if env_type in ENVS:
        return None
    if is_import_path(env_type):
        return find_path_problem(env_type)
    return ENVS.unknown_message(env_type) + "; or an import path module:Class"
