"""The checks components keep beside their own code, found by name.

Each entry is ``"module:function"``, imported at its first use: ``roll_ds/config/`` imports none of
these modules (they import the config schema, and sit above it), as it reaches a backend's checks
through ``StrategySpec.role_checks``. A component adds a check with one line here and one call
where ``validate`` collects it. Every function returns problem lines, each naming the field and
the fix.
"""

from __future__ import annotations

from collections.abc import Callable

from roll_ds.registry import Registry

COMPONENT_CHECKS: Registry[Callable[..., list[str]]] = Registry("config check")
for _name, _target in {
    # (name, role) of each reward role: its reward function specs, its scorer
    "reward_role": "roll_ds.rewards.config_checks:reward_role_problems",
    # (cfg) the weight_sync section: transport name, bucket size, LoRA sync
    "weight_sync": "roll_ds.weight_sync.config_checks:weight_sync_problems",
    # (cfg) the transport against the device ids (no NCCL between ranks sharing a GPU)
    "weight_sync_layout": "roll_ds.weight_sync.select:layout_problems",
    # (cfg) the colocation section
    "colocation": "roll_ds.pipeline.colocation.checks:colocation_problems",
    # (cfg) validation sampling fields, save_best
    "evaluation": "roll_ds.pipeline.eval_metrics:eval_config_problems",
    # (cfg) the agentic section: environments, tools, parsers
    "agentic": "roll_ds.agentic.config_checks:agentic_problems",
    # (cfg, *, check_files) DeepSpeed roles: ZeRO++ against device and nodes, NVMe offload
    # against libaio and the disk
    "deepspeed": "strategies.deepspeed.config_checks:deepspeed_run_problems",
    # (cfg) what the DeepSpeed roles cannot do on cfg.device (ZeRO++ on cpu)
    "deepspeed_device": "strategies.deepspeed.config_checks:deepspeed_device_problems",
    # (cfg) what the rollout engine refuses on cfg.device (vLLM's seeded chunked prefill on cpu)
    "rollout_device": "strategies.vllm.config_checks:seeded_sampling_problems",
    # (cfg, *, check_files) sequence_parallel_size: roles, strategies, world sizes, attention,
    # and the model's head counts
    "sequence_parallel": "strategies.deepspeed.sequence_parallel_checks:sequence_parallel_problems",
    # (cfg, *, check_files) data keys, formats, files
    "data": "roll_ds.data.sources:data_problems",
}.items():
    COMPONENT_CHECKS.register_lazy(_name, _target)


def component_problems(name: str, *args, **kwargs) -> list[str]:
    """The problems component check ``name`` finds (its arguments as listed above)."""
    return COMPONENT_CHECKS.get(name)(*args, **kwargs)
