"""Scalar fields against their allowed values (the tables in ``roll_ds.config.ranges``)."""

from __future__ import annotations

from roll_ds.config import ranges
from roll_ds.config.roles import TRAIN_ROLES
from roll_ds.config.schema import RewardConfig, RLVRConfig, WorkerConfig


def pipeline_field_problems(cfg: RLVRConfig) -> list[str]:
    """The pipeline-wide sections' scalar fields; the roles' are ``role_field_problems``."""
    sections = [
        ("", cfg, ranges.PIPELINE),
        ("algorithm", cfg.algorithm, ranges.ALGORITHM),
        ("async_generation", cfg.async_generation, ranges.ASYNC_GENERATION),
        ("weight_sync", cfg.weight_sync, ranges.WEIGHT_SYNC),
        ("fault_tolerance", cfg.fault_tolerance, ranges.FAULT_TOLERANCE),
        ("ray", cfg.ray, ranges.RAY),
        ("tracking", cfg.tracking, ranges.TRACKING),
        ("validation", cfg.validation, ranges.VALIDATION),
        ("validation.generating_args", cfg.validation.generating_args, ranges.GENERATING_ARGS),
        ("validation.data_args", cfg.validation.data_args, ranges.DATA_ARGS),
    ]
    problems = []
    for prefix, section, rules in sections:
        problems += ranges.field_problems(prefix, section, rules)
    return problems


def role_field_problems(name: str, role: WorkerConfig) -> list[str]:
    """A role's scalar fields; only the sections the role reads."""
    sections = [("", role, ranges.WORKER), ("model_args", role.model_args, ranges.MODEL_ARGS)]
    if name in TRAIN_ROLES:
        sections.append(("training_args", role.training_args, ranges.TRAINING_ARGS))
    # the rollout engine's, and a judge's (it generates its verdicts with them)
    if name == "actor_infer" or (isinstance(role, RewardConfig) and role.judge is not None):
        sections.append(("generating_args", role.generating_args, ranges.GENERATING_ARGS))
    if name == "actor_train":
        sections.append(("data_args", role.data_args, ranges.DATA_ARGS))
    if isinstance(role, RewardConfig):
        sections.append(("", role, ranges.REWARD))
    problems = []
    for prefix, section, rules in sections:
        problems += ranges.field_problems(f"{name}.{prefix}".rstrip("."), section, rules)
    return problems
