"""Checks across roles: group size, the train batch arithmetic, the reference, reward domains,
the algorithm, asynchronous generation and the input paths."""

from __future__ import annotations

from pathlib import Path

from roll_ds.config.agentic import has_environments, row_groups
from roll_ds.config.checks.components import component_problems
from roll_ds.config.estimators import ESTIMATOR_OPTIONS, needs_critic
from roll_ds.config.role_placement import RolePlacement, role_configs
from roll_ds.config.roles import TRAIN_ROLES
from roll_ds.config.schema import EMBEDDED_AGENT, EMBEDDED_MODEL, EMBEDDED_RM, RLVRConfig
from roll_ds.config.strategies import can, names_with


def pipeline_problems(cfg: RLVRConfig, placements: dict[str, RolePlacement]) -> list[str]:
    """Roles against each other (``placements``: the roles whose placement parsed)."""
    group = cfg.num_return_sequences_in_group
    infer_n = cfg.actor_infer.generating_args.num_return_sequences
    problems = []
    if infer_n != group and row_groups(cfg) > 0:  # environment turns are one sample each
        problems.append(
            f"actor_infer.generating_args.num_return_sequences: {infer_n} != "
            f"num_return_sequences_in_group {group}; set it to ${{num_return_sequences_in_group}}"
        )
    for name in TRAIN_ROLES:
        if name in placements:
            problems += train_batch_problems(cfg, name, placements[name])
    lora = cfg.actor_train.model_args.lora_rank is not None
    if cfg.algorithm.kl_coef > 0 and not lora and cfg.reference is None:
        problems.append(
            "reference: algorithm.kl_coef > 0 needs reference log-probs; configure "
            "`reference:` or use LoRA (the adapter-disabled actor is the reference)"
        )
    problems += component_problems("weight_sync", cfg)
    if not cfg.rewards and row_groups(cfg) > 0:  # environments reward their episodes
        problems.append("rewards: no reward role; add e.g. rewards.math with reward_fns")
    problems += domain_problems(cfg)
    return problems


def train_batch_problems(cfg: RLVRConfig, name: str, train: RolePlacement) -> list[str]:
    """The step's samples must split into whole optimizer steps of the role."""
    args = getattr(cfg, name).training_args
    group = cfg.num_return_sequences_in_group
    sizes = (args.per_device_train_batch_size, args.gradient_accumulation_steps, train.world_size)
    if min(*sizes, cfg.rollout_batch_size, group) < 1:
        return []  # reported by the ranges (a zero here was a ZeroDivisionError)
    step_samples = sizes[0] * sizes[1] * sizes[2]
    samples = cfg.rollout_batch_size * group
    if samples % step_samples == 0:
        return []
    return [
        f"rollout_batch_size x num_return_sequences_in_group = {cfg.rollout_batch_size} x "
        f"{group} = {samples} samples per step is not a multiple of {name}'s "
        f"train batch ({name}.training_args: per_device_train_batch_size "
        f"{args.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{args.gradient_accumulation_steps} x world size {train.world_size} = "
        f"{step_samples}); adjust one of them"
    ]


def domain_problems(cfg: RLVRConfig) -> list[str]:
    """Each domain is scored by one reward role; sampled domains have a reward role; held-out
    data exists when evaluation is on."""
    problems = []
    owner: dict[str, str] = {}
    for role_name, reward in cfg.rewards.items():
        for tag in reward.tag_included:
            if tag in owner:
                problems.append(
                    f"rewards.{role_name}.tag_included: domain {tag!r} is also in "
                    f"rewards.{owner[tag]}.tag_included; score each domain with one role"
                )
            owner.setdefault(tag, role_name)
    field = "actor_train.data_args.domain_interleave_probs"
    weights = cfg.actor_train.data_args.domain_interleave_probs
    if any(not w >= 0 for w in weights.values()) or (weights and sum(weights.values()) <= 0):
        problems.append(
            f"{field}: weights must be >= 0 with a positive sum, got {dict(weights)}; or leave it "
            "empty (domains in proportion to the data)"
        )
    unscored = sorted(d for d, w in weights.items() if w > 0 and d not in owner)
    if unscored and cfg.rewards:
        problems.append(
            f"{field}: domains {unscored} are scored by no reward role; add them to a "
            "rewards.<name>.tag_included"
        )
    held_out = cfg.validation.data_args.file_name or cfg.val_env_manager.tags
    if cfg.eval_steps > 0 and not held_out and not has_environments(cfg):
        problems.append(
            f"validation.data_args.file_name: eval_steps={cfg.eval_steps} evaluates on held-out "
            "data but no file is listed; list jsonl files or set eval_steps=0"
        )
    return problems


def algorithm_problems(cfg: RLVRConfig) -> list[str]:
    """The advantage estimator exists, and has the critic it reads values from."""
    algo = cfg.algorithm
    if algo.adv_estimator not in ESTIMATOR_OPTIONS:
        return [
            f"algorithm.adv_estimator: unknown advantage estimator {algo.adv_estimator!r}; valid: "
            + ", ".join(sorted(ESTIMATOR_OPTIONS))
        ]
    if needs_critic(algo.adv_estimator) and cfg.critic is None:
        return [
            f"critic: adv_estimator {algo.adv_estimator!r} needs a critic role (the value model); "
            "configure `critic:` with strategy deepspeed_train (see "
            "examples/qwen_rlvr/rlvr_ppo_gae_zero3.yaml)"
        ]
    return []


ASYNC_MODES = ("batch", "stream")


def async_problems(cfg: RLVRConfig) -> list[str]:
    """``async_generation``: its mode, and what the asynchronous loop does not do (yet)."""
    mode = cfg.async_generation.mode
    if mode not in ASYNC_MODES:
        return [f"async_generation.mode: unknown mode {mode!r}; valid: {', '.join(ASYNC_MODES)}"]
    if cfg.async_generation.max_staleness < 1:
        if mode == "stream":
            return [
                "async_generation.mode=stream streams generation beside training; set "
                "async_generation.max_staleness >= 1 (or mode=batch for the synchronous loop)"
            ]
        return []
    problems = []
    if mode == "stream":
        problems += stream_problems(cfg)
    if cfg.algorithm.dynamic_sampling:
        problems.append(
            "async_generation.max_staleness: algorithm.dynamic_sampling resamples within a step, "
            "which the asynchronous loop does not do; set async_generation.max_staleness=0 or "
            "algorithm.dynamic_sampling=false"
        )
    return problems


def stream_problems(cfg: RLVRConfig) -> list[str]:
    """``async_generation.mode=stream`` pauses vLLM's request queue for each sync."""
    problems = []
    strategy = cfg.actor_infer.strategy_args.strategy_name
    if not can(strategy, "streams"):
        problems.append(
            f"async_generation.mode=stream needs a rollout backend with a request stream a sync "
            f"pauses (actor_infer.strategy_args.strategy_name one of {names_with('streams')}), "
            f"got {strategy!r}; use mode=batch"
        )
    if cfg.weight_sync.lora_sync == "adapter":
        problems.append(
            "async_generation.mode=stream swaps weights under requests in flight, but "
            "weight_sync.lora_sync=adapter retires the adapter those requests use; set "
            "weight_sync.lora_sync=merged or async_generation.mode=batch"
        )
    return problems


EMBEDDED_NAMES = (EMBEDDED_MODEL, EMBEDDED_RM, EMBEDDED_AGENT)
"""The ``embedded:`` model names ``roll_ds.models.shipped.SHIPPED_MODELS`` ships."""


def model_path_problem(field: str, path: str, embedded: str = EMBEDDED_MODEL) -> str | None:
    """The problem with a model path a config names (``pretrain`` or a role's
    ``model_args.model_name_or_path``), or None: it must be an embedded name or exist locally,
    since no model hub is reachable at run time. ``embedded``: the embedded model to suggest."""
    if path.startswith("embedded:"):
        if path in EMBEDDED_NAMES:
            return None
        return f"{field}: {path!r} is not an embedded model; valid: " + ", ".join(EMBEDDED_NAMES)
    if Path(path).exists():
        return None
    return (
        f"{field}: {path!r} does not exist; point it at a local model directory "
        f"(no model hub is reachable at run time) or use {embedded!r}"
    )


def model_path_problems(cfg: RLVRConfig) -> list[str]:
    """``pretrain`` and every ``model_args.model_name_or_path`` a used role names (a role
    without one loads ``pretrain``), checked before anything starts: a bad path would otherwise
    fail minutes later inside the role's actor."""
    found = [model_path_problem("pretrain", cfg.pretrain)]
    for name, role in role_configs(cfg):
        path = role.model_args.model_name_or_path
        if path is not None:
            scorer = name.startswith("rewards.") and getattr(role, "head", None) is not None
            embedded = EMBEDDED_RM if scorer else EMBEDDED_MODEL
            field = f"{name}.model_args.model_name_or_path"
            found.append(model_path_problem(field, path, embedded))
    return [p for p in found if p is not None]


def path_problems(cfg: RLVRConfig) -> list[str]:
    """The model directories and the training data are given (and the models exist)."""
    problems = model_path_problems(cfg)
    if not cfg.actor_train.data_args.file_name:
        problems.append(
            "actor_train.data_args.file_name: no training data; list .jsonl / .json / .parquet "
            "files or directories"
        )
    return problems
