"""The backends by name: ``STRATEGY_SPECS`` (``"module:Class"`` plus what each can do and the
``"module:function"`` of its own config checks) and the ``STRATEGIES`` registry built from it.

It lives in the config layer because validation reads it (a role's ``strategy_name``, the
backend's ``role_checks`` / ``rollout_checks``) without importing any backend: entries are lazy
strings, so listing names and validating a config imports no torch, DeepSpeed or vLLM. The
contracts a backend implements are ``roll_ds/strategy.py``'s, which re-exports these names.

Adding a backend: a module under ``strategies/`` plus one ``STRATEGY_SPECS`` line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from roll_ds.registry import Registry, import_target


@dataclass(frozen=True)
class StrategySpec:
    """What a backend can do, known without importing it."""

    target: str  # "module:Class"
    trains: bool  # implements TrainStrategy
    generates: bool  # implements generate()
    # "module:function", called as f(name, role, where) -> list[str]: problems of a role's
    # strategy_args (``where``: its ``roll_ds.config.role_placement.RolePlacement`` or None).
    role_checks: str | None = None
    # "module:function", called as f(cfg, *, check_files) -> list[str] when the backend is
    # actor_infer's: the pipeline's lengths against the rollout engine's context.
    rollout_checks: str | None = None
    # reads a role's max_tokens_per_micro_batch / use_sequence_packing (strategies/micro_batches)
    token_micro_batches: bool = False
    # A rollout backend with a sleep mode: ``offload_states(level=1|2)`` frees its device memory,
    # ``reload_states(tags=[...])`` brings back "weights" and / or "kv_cache" (None: both). The
    # colocation choreography (roll_ds/pipeline/colocation/choreography.py) sleeps it while
    # colocated trainers compute.
    sleeps: bool = False
    # Sizes itself at start as a share of the whole GPU (vLLM's strategy_config
    # gpu_memory_utilization, sized as if the GPU were empty) and can turn its sleep mode off
    # (enable_sleep_mode): colocation's memory checks apply to it beside trainers.
    gpu_memory_share: bool = False
    # generate: every request seeded on its own (what a prompt samples does not depend on the
    # batch it is in), a token limit per request: environment episodes need it
    per_request_seeds: bool = False
    # generate(probe=...): scores parity-probe rows in the same engine steps as the rollout
    probe_in_generate: bool = False
    # a request stream a weight sync pauses between decode steps (async_generation.mode=stream)
    streams: bool = False
    # train_step_with_old_logprobs: the old log-probs from the train step's own forwards
    old_logprobs_in_train_step: bool = False
    # built with a reward-model head, scores whole sequences (score_sequences)
    scores_sequences: bool = False
    # serves a base model plus a synced LoRA adapter (weight_sync.lora_sync=adapter)
    serves_adapters: bool = False
    # "module:function", called by the driver before any trainer starts as
    # f(path, tag, *, timeout_s) when a trained role resumes on another data-parallel size than
    # its checkpoint ``path/tag`` was saved on: prepares what the strategy's load reads (None:
    # the load needs nothing prepared).
    resized_resume: str | None = None


def names_with(ability: str) -> list[str]:
    """The strategy names whose spec has ``ability`` (a flag above), sorted: for messages."""
    return sorted(name for name, spec in STRATEGY_SPECS.items() if getattr(spec, ability))


def can(strategy_name: str | None, ability: str) -> bool:
    """Whether the backend ``strategy_name`` has ``ability``; an unknown name has none (its
    own check reports it)."""
    spec = STRATEGY_SPECS.get(strategy_name or "")
    return spec is not None and bool(getattr(spec, ability))


_DEEPSPEED_CHECKS = "strategies.deepspeed.config_checks:strategy_config_problems"

STRATEGY_SPECS: dict[str, StrategySpec] = {
    "deepspeed_train": StrategySpec(
        "strategies.deepspeed.train:DeepSpeedTrainStrategy",
        trains=True,
        generates=False,
        role_checks=_DEEPSPEED_CHECKS,
        token_micro_batches=True,
        old_logprobs_in_train_step=True,
        resized_resume="strategies.deepspeed.universal:prepare_resized",
    ),
    "deepspeed_infer": StrategySpec(
        "strategies.deepspeed.infer:DeepSpeedInferStrategy",
        trains=False,
        generates=False,
        role_checks=_DEEPSPEED_CHECKS,
        token_micro_batches=True,
        scores_sequences=True,
    ),
    "hf_infer": StrategySpec(
        "strategies.hf_infer:HfInferStrategy",
        trains=False,
        generates=True,
        token_micro_batches=True,
        sleeps=True,  # weights to host memory; HF generate holds no KV cache between calls
        scores_sequences=True,
    ),
    "vllm": StrategySpec(
        "strategies.vllm.strategy:VllmStrategy",
        trains=False,
        generates=True,
        role_checks="strategies.vllm.config_checks:strategy_config_problems",
        rollout_checks="strategies.vllm.config_checks:rollout_problems",
        sleeps=True,
        gpu_memory_share=True,
        per_request_seeds=True,
        probe_in_generate=True,
        streams=True,
        serves_adapters=True,
    ),
}

STRATEGIES: Registry[type] = Registry("strategy_name")
for _name, _spec in STRATEGY_SPECS.items():
    STRATEGIES.register_lazy(_name, _spec.target)


def load_hook(target: str) -> Callable[..., list[str]]:
    """The function a spec's ``"module:function"`` hook names (imported on first use)."""
    return import_target(target)
