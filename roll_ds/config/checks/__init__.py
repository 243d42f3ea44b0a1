"""The pipeline-level checks ``roll_ds.config.validate`` collects; each returns problem lines.

    fields.py    scalar fields against their ranges (``ranges.py``), pipeline sections and roles
    roles.py     one role: its strategy (name, capabilities, the backend's own checks through the
                 registry), its devices against the cluster, its LoRA targets
    pipeline.py  across roles: group size, train batch arithmetic, reference, reward domains,
                 algorithm, asynchronous generation, input paths
    lengths.py   generation lengths against response_length and the rollout engine's context

    components.py  ``COMPONENT_CHECKS``: the components' own checks by ``"module:function"``

Components check their own sections beside their code (``*_problems`` / ``*_checks``), reached by
name so that nothing here imports them: the backends through
``roll_ds.config.strategies.STRATEGY_SPECS`` (``strategies/vllm/config_checks.py``,
``strategies/deepspeed/config_checks.py``); rewards (``roll_ds/rewards/config_checks.py``), weight
sync (``roll_ds/weight_sync/config_checks.py``, ``select.py``), data, colocation, evaluation and
agentic through ``components.COMPONENT_CHECKS``; the platform is below config and imported. No
torch, Ray, DeepSpeed or vLLM is imported here.
"""
