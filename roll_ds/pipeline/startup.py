"""Start-up of the pipeline's roles: connect to Ray, reserve the placement, create each role's
cluster of actors with its strategy context and threads, and initialize them in the order the
colocation choreography allows (engines before the trainers that share their GPUs).

``RLVRPipeline.start`` calls these in order; each step fills the pipeline's state as it goes,
so ``shutdown`` releases whatever a failed start had already taken.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from roll_ds import timeline
from roll_ds.config.checks.lengths import longest_sequence
from roll_ds.config.deepspeed import role_nvme_dir
from roll_ds.config.schema import RLVRConfig
from roll_ds.pipeline.colocation.choreography import TRACE_FILE, Choreography, cluster_runner
from roll_ds.pipeline.colocation.plan import ColocationPlan, plan_colocation
from roll_ds.pipeline.passes import schedule_steps
from roll_ds.pipeline.startup_report import StartupReport
from roll_ds.strategy import StrategyContext
from roll_ds.threads import role_threads

logger = logging.getLogger(__name__)


def rollout_temperature(cfg: RLVRConfig) -> float:
    """The temperature rollouts are sampled at, which every log-prob the trainer and the
    reference compute uses too (PPO's ratio and the KL are then of the sampling policy);
    1.0 for greedy rollouts."""
    temperature = cfg.actor_infer.generating_args.temperature
    return float(temperature) if temperature > 0 else 1.0


def strategy_context(cfg: RLVRConfig, model_dir: str, tokenizer: Any) -> StrategyContext:
    """What every role's strategy is built with (the trained roles' schedule is set later)."""
    eos = tokenizer.eos_token_id
    return StrategyContext(
        pretrain=model_dir,
        seed=cfg.seed,
        max_steps=cfg.max_steps,
        response_length=cfg.response_length,
        stop_token_ids=(eos,) if eos is not None else (),
        logprob_temperature=rollout_temperature(cfg),
        process_group_timeout_s=cfg.fault_tolerance.process_group_timeout_s,
    )


def reward_roles(cfg: RLVRConfig) -> list[str]:
    return [f"rewards.{name}" for name in cfg.rewards]


def reserve_resources(cfg: RLVRConfig, *, eval_only: bool) -> Any:
    """The placement groups of every role (``eval_only``: the rollout and reward roles)."""
    from roll_ds.distributed.resource_manager import ResourceManager

    only = ["actor_infer", *reward_roles(cfg)] if eval_only else None
    return ResourceManager.from_config(cfg, roles=only).reserve()


def model_roles(cfg: RLVRConfig, *, use_critic: bool, eval_only: bool) -> dict[str, type]:
    """``{role: worker class}`` of the model roles to start, in start order."""
    from roll_ds.pipeline.workers import (
        ActorTrainWorker,
        CriticWorker,
        RolloutWorker,
        StrategyWorker,
    )

    if eval_only:
        return {"actor_infer": RolloutWorker}
    roles: dict[str, type] = {"actor_train": ActorTrainWorker, "actor_infer": RolloutWorker}
    if cfg.reference is not None:
        roles["reference"] = StrategyWorker
    if use_critic:
        roles["critic"] = CriticWorker
    return roles


def role_context(
    cfg: RLVRConfig, ctx: StrategyContext, name: str, trained_roles: list[str]
) -> StrategyContext:
    """``ctx`` for role ``name``: a trained role's LR schedule spans all its optimizer steps;
    the rollout engines hold the longest rollout / evaluation sequence, and under adapter-only
    LoRA sync reserve the adapter's rank; every role gets its own NVMe swap directory."""
    ctx = replace(ctx, nvme_dir=role_nvme_dir(cfg.output_dir, cfg.exp_name, name))
    if name in trained_roles:
        return replace(ctx, max_steps=schedule_steps(cfg, name))
    if name != "actor_infer":
        return ctx
    ctx = replace(ctx, max_sequence_length=longest_sequence(cfg)[0])
    if cfg.weight_sync.lora_sync == "adapter":
        return replace(ctx, adapter_sync_rank=cfg.actor_train.model_args.lora_rank)
    return ctx


def create_clusters(
    clusters: dict[str, Any],
    cfg: RLVRConfig,
    roles: dict[str, type],
    resources: Any,
    ctx: StrategyContext,
    trained_roles: list[str],
    report: StartupReport | None = None,
) -> None:
    """Add a cluster of actors to ``clusters`` for every model role and reward role (their
    start phases into ``report``)."""
    from roll_ds.distributed.cluster import Cluster
    from roll_ds.pipeline.workers import RewardWorker

    threads = role_threads(
        cfg, on_cuda=resources.plan.device_resource == "GPU", plan=resources.plan
    )
    logger.info("threads per actor: %s", threads)
    # Every role's actors are asked for at once (not waited for here: initialize_roles): they
    # boot in parallel, and their initialize calls queue behind their __init__.
    starts = [
        (name, cls, getattr(cfg, name), role_context(cfg, ctx, name, trained_roles))
        for name, cls in roles.items()
    ]
    starts += [(f"rewards.{n}", RewardWorker, r, ctx) for n, r in cfg.rewards.items()]
    for name, cls, role_cfg, role_ctx in starts:
        if report is not None:
            report.role_asked(name, time.time())
        clusters[name] = Cluster(
            name,
            cls,
            resources,
            init_args=(role_cfg, role_ctx),
            env=role_cfg.system_envs,
            num_threads=threads.get(name),
            call_timeout_s=cfg.fault_tolerance.call_timeout_s,
            wait=False,
        )


def choreography(
    cfg: RLVRConfig, clusters: dict[str, Any], device_resource: str, out_dir: Path, *, eval_only
) -> Choreography:
    """The colocation choreography over ``clusters`` (evaluation alone has no trainer to take
    turns with)."""
    plan = ColocationPlan() if eval_only else plan_colocation(cfg, device_resource)
    return Choreography(plan, run=cluster_runner(clusters), trace_path=out_dir / TRACE_FILE)


def initialize_roles(
    clusters: dict[str, Any],
    colocation: Choreography,
    roles: list[str],
    report: StartupReport | None = None,
) -> None:
    """Initialize ``roles`` stage by stage: roles that share the rollout engines' GPUs start
    after them (colocation/choreography.py: why); the reward roles load meanwhile. Bounded as
    start-up (at least the cluster's ``start_timeout_s``): a ``call_timeout_s`` lowered to
    catch a stuck rank sooner must not fail a slow start (every role loads at once). The ranks'
    phases go into ``report``."""
    for i, stage in enumerate(colocation.start_stages(roles)):
        with timeline.phase(f"initialize stage {i}", roles=list(stage)):
            pending = [clusters[n].submit("initialize") for n in stage]
            if i == 0:  # every role's actors were asked for at once (create_clusters)
                for name in roles:
                    clusters[name].wait_started()
                    if report is not None:
                        report.add_ranks(name, clusters[name].infos)
            for name, call in zip(stage, pending, strict=True):
                cluster = call.cluster
                ranks = call.get(max(cluster.call_timeout_s or 0.0, cluster.start_timeout_s))
                log_started(name, ranks)
                if report is not None:
                    report.add_ranks(name, ranks)
        colocation.started(stage)


def log_started(role: str, ranks: Any) -> None:
    """Log what rank 0 of ``role`` says it runs (a trainer: its ZeRO stage in use, offload and
    precision; ``DeepSpeedTrainStrategy.summary``)."""
    first = ranks[0] if isinstance(ranks, list) and ranks else None
    summary = first.get("summary") if isinstance(first, dict) else None
    if summary:
        logger.info("%s: %s", role, summary)
