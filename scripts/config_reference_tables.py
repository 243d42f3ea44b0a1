"""What the configuration reference says beside the schema's own comments: allowed values
validation reads from places other than ``ranges.py``, and who reads each section
(``scripts/config_reference.py`` fails naming a section or top-level key missing here)."""

from __future__ import annotations

from typing import Any

from roll_ds.config import agentic, fault_tolerance, ranges, schema
from roll_ds.config.checks.pipeline import ASYNC_MODES
from roll_ds.config.compose import PROJECT_ROOT
from roll_ds.config.estimators import ESTIMATOR_OPTIONS
from roll_ds.config.strategies import STRATEGY_SPECS
from roll_ds.platform import DEVICES

# The DeepSpeed presets of examples/config, each a top-level key the composition reads.
PRESET_NAMES = tuple(sorted(p.stem for p in (PROJECT_ROOT / "examples" / "config").glob("*.yaml")))

# The allowed values of each section's scalar fields: ranges.py's tables, plus names listed by
# torch-free modules that validation checks them against.
RANGES: dict[type, dict[str, Any]] = {
    schema.RLVRConfig: {
        **ranges.PIPELINE,
        "device": ranges.OneOf(DEVICES),
        "save_best_mode": ranges.OneOf(("max", "min")),
    },
    schema.AlgorithmConfig: {
        **ranges.ALGORITHM,
        "adv_estimator": ranges.OneOf(tuple(ESTIMATOR_OPTIONS)),
    },
    schema.AsyncGenerationConfig: {**ranges.ASYNC_GENERATION, "mode": ranges.OneOf(ASYNC_MODES)},
    schema.ColocationConfig: {
        "offload": ranges.OneOf(("auto", "always", "never")),
        "sleep_level": ranges.OneOf((1, 2)),
    },
    schema.WeightSyncConfig: {
        **ranges.WEIGHT_SYNC,
        "transport": ranges.OneOf(("auto", "collective", "object_store", "cuda_ipc")),
        "lora_sync": ranges.OneOf(("merged", "adapter")),
    },
    fault_tolerance.FaultToleranceConfig: ranges.FAULT_TOLERANCE,
    schema.RayConfig: ranges.RAY,
    schema.TrackingConfig: ranges.TRACKING,
    schema.ValidationConfig: ranges.VALIDATION,
    schema.GeneratingArgs: ranges.GENERATING_ARGS,
    schema.DataArgs: {
        **ranges.DATA_ARGS,
        "answer_format": ranges.OneOf(("raw", "gsm8k")),
    },
    schema.WorkerConfig: ranges.WORKER,
    schema.ModelArgs: ranges.MODEL_ARGS,
    schema.TrainingArgs: ranges.TRAINING_ARGS,
    schema.StrategyArgs: {"strategy_name": ranges.OneOf(tuple(STRATEGY_SPECS))},
    schema.RewardConfig: {
        **ranges.REWARD,
        "head": ranges.OneOf((None, "sequence_classification", "value")),
        "input_template": ranges.OneOf(("raw", "chat")),
    },
    agentic.AgenticConfig: {"reward_mode": ranges.OneOf(agentic.REWARD_MODES)},
    agentic.EnvSpecConfig: {
        "observation_truncation_side": ranges.OneOf(agentic.TRUNCATION_SIDES),
    },
}

# Who reads each section (by its path below) and each group of top-level keys.
READERS = {
    "algorithm": "the driver's advantage phase (`roll_ds/pipeline/batch_advantages.py`, "
    "`roll_ds/algorithms/`) and the trainers' loss (`roll_ds/pipeline/loss_fns.py`); "
    "`old_logprobs` the log-prob phase (`roll_ds/pipeline/logprobs.py`)",
    "async_generation": "the loop and its rollout queue (`roll_ds/pipeline/rollout_queue.py`, "
    "`rollout_phase.py`), the vLLM strategy's request stream (`strategies/vllm/stream.py`)",
    "colocation": "the colocation choreography (`roll_ds/pipeline/colocation/`)",
    "weight_sync": "the policy sync phase and its transports (`roll_ds/pipeline/policy_sync.py`, "
    "`roll_ds/weight_sync/`)",
    "fault_tolerance": "the replacement of dead or stuck workers of stateless roles "
    "(`roll_ds/pipeline/faults.py`, `roll_ds/distributed/recovery.py`), the driver's restart "
    "loop (`roll_ds/pipeline/launch.py`, `roll_ds/pipeline/restarts.py`) and the bound of every "
    "actor call (`roll_ds/distributed/cluster.py`, `roll_ds/pipeline/engines.py`)",
    "export": "the loop at each save and at the end (`roll_ds/pipeline/rlvr.py`, "
    "`roll_ds/export.py`)",
    "validation": "the evaluation phase (`roll_ds/pipeline/evaluation.py`) and "
    "`python -m roll_ds.evaluate`",
    "ray": "the driver's Ray connection (`roll_ds/distributed/ray_init.py`)",
    "tracking": "the driver's reporting (`roll_ds/pipeline/reporting.py`, `roll_ds/tracking.py`)",
    "<role>": "the role's actors (`roll_ds/pipeline/workers.py`) and their placement "
    "(`roll_ds/distributed/placement.py`); `actor_train` (the `deepspeed_train` trainer), "
    "`actor_infer` (the `vllm` or `hf_infer` rollout engines), `reference` (reference "
    "log-probs; null under LoRA), `critic` (the value model, `adv_estimator: gae`)",
    "<role>.strategy_args": "the role's worker, which builds the strategy by name "
    "(`roll_ds/config/strategies.py`, `strategies/`)",
    "<role>.model_args": "the role's strategy when it loads the model "
    "(`roll_ds/models/loading.py`, `strategies/deepspeed/loading.py`, `strategies/vllm/`)",
    "<role>.training_args": "the trainers (`actor_train`, `critic`): "
    "`strategies/deepspeed/optimizer.py`, `train.py` and the DeepSpeed preset's `auto` values "
    "(`roll_ds/config/deepspeed.py`)",
    "<role>.generating_args": "the rollout engines (`actor_infer`: `strategies/vllm/`, "
    "`strategies/hf_infer.py`) and a judge (`roll_ds/rewards/judge.py`)",
    "<role>.data_args": "`actor_train`'s: the step's task sampler (`roll_ds/data/`, "
    "`roll_ds/pipeline/tasks.py`)",
    "rewards.<name>": "the reward role's actors (`roll_ds/rewards/scorer.py`, "
    "`model_reward.py`, `judge.py`); the rows of its `tag_included` domains are routed to it "
    "(`roll_ds/pipeline/scoring.py`)",
    "rewards.<name>.strategy_args": "the reward role's worker, when it serves a model",
    "rewards.<name>.score_transform": "the reward-model term (`roll_ds/rewards/model_reward.py`)",
    "rewards.<name>.judge": "the judge term (`roll_ds/rewards/judge.py`)",
    "rewards.<name>.judge.patterns[]": "the judge term (`roll_ds/rewards/judge.py`)",
    "validation.data_args": "the evaluation's held-out rows (`roll_ds/pipeline/tasks.py`)",
    "validation.generating_args": "the evaluation's sampling (`roll_ds/pipeline/evaluation.py`)",
    "custom_envs.<tag>": "the episode runner and the environment workers "
    "(`roll_ds/agentic/runner.py`, `env_pool.py`)",
    "train_env_manager": "the step's task list (`roll_ds/pipeline/tasks.py`)",
    "val_env_manager": "the evaluation's task list (`roll_ds/pipeline/tasks.py`)",
    "agentic": "the episode runner and environment workers (`roll_ds/agentic/`), the "
    "advantages of episodes (`reward_mode`, `turn_gamma`)",
}

TOP_LEVEL_GROUPS: dict[str, tuple[tuple[str, ...], str]] = {
    "The run": (
        ("exp_name", "seed", "output_dir", "pretrain"),
        "the driver (`roll_ds/pipeline/startup.py`, `rlvr.py`): output paths, the policy "
        "every model role loads, the seeds of data, sampling and environments",
    ),
    "The cluster": (
        ("num_gpus_per_node", "num_nodes", "device", "cpus_per_gpu", "system_envs"),
        "placement and Ray (`roll_ds/platform.py`, `roll_ds/distributed/placement.py`, "
        "`ray_init.py`); `system_envs` every actor",
    ),
    "Schedule and checkpoints": (
        (
            "max_steps",
            "save_steps",
            "keep_last",
            "save_best",
            "save_best_mode",
            "logging_steps",
            "eval_steps",
            "resume_from_checkpoint",
        ),
        "the loop (`roll_ds/pipeline/rlvr.py`, `save_resume.py`) and `roll_ds/checkpoint.py`; "
        "`max_steps` also the LR schedule",
    ),
    "Batch shape": (
        ("rollout_batch_size", "num_return_sequences_in_group", "prompt_length", "response_length"),
        "the step's tasks and rollouts (`roll_ds/pipeline/tasks.py`, `rollout_phase.py`, "
        "`packing.py`), the rollout engines (`max_model_len`)",
    ),
    "Composition": (
        ("replace", *PRESET_NAMES),
        "composition (`roll_ds/config/replace.py`); a preset is read by the roles whose "
        "`strategy_config` names it (`${deepspeed_zero3}`), through `roll_ds/config/deepspeed.py`",
    ),
}
PLACEHOLDERS = {"rewards": "<name>", "custom_envs": "<tag>"}  # what a dict section's key names
# Where a class that several sections share is documented in full; the others list the
# defaults that differ.
PRIMARY = {
    schema.DataArgs: "<role>.data_args",
    schema.GeneratingArgs: "<role>.generating_args",
    schema.StrategyArgs: "<role>.strategy_args",
    agentic.EnvManagerConfig: "train_env_manager",
}
