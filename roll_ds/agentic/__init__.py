"""Multi-turn agentic RL: environments, tools and episodes.

env.py        the environment contract (``reset(seed)`` / ``step(action)``) and ``StepResult``
registry.py   environments, tool parsers and tools by name (lazy, like the other registries)
parsers.py    tool-call parsers (``hermes``: Qwen2.5's ``<tool_call>{...}</tool_call>``)
tools.py      tools declared with a JSON schema, and ``ToolEnv``: a task solved with tools
envs/         the shipped environments
chat.py       messages -> tokens: the first prompt, then each observation's tokens alone
truncation.py an over-long reply message cut to max_observation_tokens, a marker at the cut
episode.py    one episode's token bookkeeping (policy tokens, observation tokens, masks)
runner.py     many episodes stepped together: one generate call per turn, env steps in parallel
"""
