"""The RLVR loop. One step reads like DESIGN.md's step list:

    weights -> rollout -> reward -> filter -> logprob -> advantage -> train -> log / checkpoint

With a critic estimator (gae) the critic role computes the rollout's values in the logprob phase,
the advantage phase turns them into advantages and returns, and the critic trains on the returns
beside the actor.

Everything that can fail on bad input (model path, data files, domain routing, algorithm names)
is checked in ``__init__``, before any Ray actor starts; ``start()`` brings the roles up.

Each phase has its module: ``startup`` (the roles), ``policy_sync`` (weights into the engines,
parity), ``rollout_phase`` (generate, score, dynamic sampling, the async queue), ``logprobs``,
``batch_advantages``, ``passes`` (PPO epochs of training), ``save_resume`` (checkpoints),
``reporting`` (timings, tracker, curves); the losses shipped to the trainers are ``loss_fns``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from roll_ds.checkpoint import BestCheckpoint, CheckpointManager
from roll_ds.config.estimators import needs_critic
from roll_ds.config.schema import RLVRConfig
from roll_ds.data.sampler import PromptSampler
from roll_ds.distributed.batch import Batch
from roll_ds.export import export_run_step, hf_step_dir
from roll_ds.models.shipped import resolve_pretrain
from roll_ds.pipeline.batch_advantages import batch_advantages, mismatch_metrics
from roll_ds.pipeline.colocation import GENERATE, TRAIN, Choreography, ColocationPlan
from roll_ds.pipeline.evaluation import evaluate_policy
from roll_ds.pipeline.logprobs import (
    fill_logprobs,
    old_logprobs_in_train_step,
    reuse_rollout_logprobs,
)
from roll_ds.pipeline.loss_fns import CRITIC_KEYS, TRAIN_KEYS, PolicyLoss, ValueLoss
from roll_ds.pipeline.passes import train_passes
from roll_ds.pipeline.policy_sync import PolicySync
from roll_ds.pipeline.prompt_rows import encode_prompts, load_prompt_rows
from roll_ds.pipeline.reporting import (
    add_step_totals,
    dump_rollouts,
    open_tracker,
    plot_run_curves,
    progress_postfix,
    timed,
)
from roll_ds.pipeline.rollout import domain_routes
from roll_ds.pipeline.rollout_phase import RolloutPhase
from roll_ds.pipeline.rollout_queue import RolloutQueue
from roll_ds.pipeline.save_resume import resume_run, save_run_checkpoint
from roll_ds.pipeline.seeds import step_seed
from roll_ds.pipeline.sequences import pad_token_id
from roll_ds.pipeline.startup import (
    choreography,
    create_clusters,
    initialize_roles,
    model_roles,
    reserve_resources,
    reward_roles,
    strategy_context,
)
from roll_ds.tracking import ROLLOUTS_FILE

logger = logging.getLogger(__name__)

ASYNC_TIS_CAP = 2.0  # algorithm.tis_cap when it is null under async_generation


class RLVRPipeline:
    """The RLVR loop over the roles' actors. ``cfg`` has passed ``roll_ds.config.validate`` (the
    entry points validate before building this), so names, modes and roles are not re-checked."""

    def __init__(self, cfg: RLVRConfig) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg.output_dir) / cfg.exp_name
        algo = cfg.algorithm
        self.queue = (
            RolloutQueue(cfg.async_generation.max_staleness)
            if cfg.async_generation.max_staleness
            else None
        )
        if self.queue is not None and algo.tis_cap is None:  # async: correct for stale rollouts
            algo = replace(algo, tis_cap=ASYNC_TIS_CAP)
        self.loss_fn = PolicyLoss.from_config(algo, cfg.response_length)
        self.use_critic = needs_critic(algo.adv_estimator)
        self.value_loss_fn = (
            ValueLoss.from_config(algo, cfg.response_length) if self.use_critic else None
        )
        self._load_data()
        self.checkpoints = CheckpointManager(self.out_dir / "checkpoints", keep_last=cfg.keep_last)
        self.best: BestCheckpoint | None = None  # save_best: the first save sets it up
        self.exported: Path | None = None  # the latest Hugging Face export
        self.clusters: dict[str, Any] = {}
        # The trainer's weight version: the number of train steps taken (the engines' is
        # policy_sync.rollout_version).
        self.policy_version = 0
        self._unreported_sync: dict[str, float] = {}
        self.colocation = Choreography(ColocationPlan())  # start() plans it from the placement
        self.rollouts: RolloutPhase | None = None  # start() builds the phases over the roles
        self.policy_sync: PolicySync | None = None

    def _load_data(self) -> None:
        """Train and eval rows, tokenizer, domain routes, sampler. Data first: malformed rows
        are reported before the model is built or loaded."""
        from transformers import AutoTokenizer

        cfg = self.cfg
        train_args, eval_args = cfg.actor_train.data_args, cfg.validation.data_args
        train_rows = load_prompt_rows(train_args)
        eval_rows = load_prompt_rows(eval_args)
        if cfg.validation.max_prompts:
            eval_rows = eval_rows[: cfg.validation.max_prompts]
        self.model_dir = resolve_pretrain(cfg.pretrain)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        limit = cfg.prompt_length
        self.train_rows = encode_prompts(
            self.tokenizer, train_rows, train_args, "actor_train", limit
        )
        self.eval_rows = encode_prompts(self.tokenizer, eval_rows, eval_args, "validation", limit)
        domains = {r["domain"] for r in self.train_rows + self.eval_rows}
        self.routes = domain_routes(
            sorted(domains), {name: r.tag_included for name, r in cfg.rewards.items()}
        )
        self.sampler = PromptSampler(
            self.train_rows,
            seed=cfg.seed,
            domain_probs=dict(train_args.domain_interleave_probs),
        )

    # --- start-up --------------------------------------------------------------------------

    def start(self, *, eval_only: bool = False) -> None:
        """Start every role's actors. ``eval_only`` (``python -m roll_ds.evaluate``): only the
        rollout engines and the reward roles, serving the loaded model as the current policy."""
        from roll_ds.distributed.ray_init import connect_from_config

        cfg = self.cfg
        self.ray = connect_from_config(cfg)
        logger.info(self.ray.summary())
        self.resources = reserve_resources(cfg, eval_only=eval_only)
        roles = model_roles(cfg, use_critic=self.use_critic, eval_only=eval_only)
        ctx = strategy_context(cfg, self.model_dir, self.tokenizer)
        create_clusters(self.clusters, cfg, roles, self.resources, ctx, self._trained_roles)
        device_resource = self.resources.plan.device_resource
        self.colocation = choreography(
            cfg, self.clusters, device_resource, self.out_dir, eval_only=eval_only
        )
        initialize_roles(self.clusters, self.colocation, [*roles, *reward_roles(cfg)])
        self.rollouts = RolloutPhase(
            cfg=cfg,
            clusters=self.clusters,
            colocation=self.colocation,
            sampler=self.sampler,
            tokenizer=self.tokenizer,
            routes=self.routes,
            train_rows=self.train_rows,
            queue=self.queue,
        )
        pad_id = pad_token_id(self.tokenizer)
        self.policy_sync = PolicySync(cfg, self.clusters, self.colocation, self.train_rows, pad_id)
        self.rollouts.parity = self.policy_sync
        if eval_only:  # no trainer to sync from: the engines serve the policy under evaluation
            self.policy_sync.rollout_version = self.policy_version

    def shutdown(self) -> None:
        """Stop every role's actors and give their placement groups back, so the same Ray
        session can start another pipeline (benchmarks and tests do)."""
        for cluster in self.clusters.values():
            cluster.shutdown()
        self.clusters = {}
        resources = getattr(self, "resources", None)
        if resources is not None:
            resources.release()
            self.resources = None

    @property
    def actor_train(self):
        return self.clusters["actor_train"]

    @property
    def actor_infer(self):
        return self.clusters["actor_infer"]

    @property
    def critic(self):
        return self.clusters["critic"]

    @property
    def _trained_roles(self) -> list[str]:
        """Roles that train every step (their engines are in every checkpoint)."""
        return ["actor_train", "critic"] if self.use_critic else ["actor_train"]

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        cfg = self.cfg
        start_step = self._maybe_resume()
        if start_step == 0:  # a fresh run: an earlier run's rollout dumps are not ours
            (self.out_dir / ROLLOUTS_FILE).unlink(missing_ok=True)
        tracker = open_tracker(cfg, self.out_dir, start_step)
        bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps)
        try:
            if start_step == 0 and cfg.eval_steps:
                tracker.log(self.evaluate(), step=0)
            for step in bar:
                metrics = self.train_one_step(step)
                done = step + 1
                if cfg.eval_steps and (done % cfg.eval_steps == 0 or done == cfg.max_steps):
                    metrics.update(self.evaluate())
                if done % max(cfg.logging_steps, 1) == 0 or done == cfg.max_steps:
                    tracker.log(metrics, step=done)
                bar.set_postfix(progress_postfix(metrics))
                if cfg.save_steps and done % cfg.save_steps == 0:
                    self.save_checkpoint(done, metrics)
        finally:
            tracker.close()
        rows = plot_run_curves(self.out_dir)
        # every_save may have exported the last step already
        if cfg.export.at_end and self.exported != hf_step_dir(self.out_dir, cfg.max_steps):
            self.colocation.enter(TRAIN, self.policy_version)
            self.exported = export_run_step(self.actor_train, self.out_dir, cfg.max_steps)
        return rows

    def train_one_step(self, step: int) -> dict[str, float]:
        """One step: weights -> rollout -> reward -> logprob -> advantage -> train. Under
        ``async_generation`` the rollout is the batch generated ahead (``rollout_queue``) while
        the next ones generate beside the training, and the new weights reach the engines at
        the end of the step: between generation batches (``mode: batch``), or between two
        decode steps of the requests in flight (``mode: stream``)."""
        timings: dict[str, float] = {}
        with timed(timings, "sync"):
            sync_metrics = self.sync_weights(defer_parity=self.defers_parity)
        sync_metrics = {**self._unreported_sync, **sync_metrics}
        self._unreported_sync = {}
        with timed(timings, "rollout"):
            batch, rollout_stats = self.rollouts.step_batch(
                step,
                policy_version=self.policy_version,
                rollout_version=self.policy_sync.rollout_version,
            )
        with timed(timings, "logprobs"):
            self.colocation.enter(TRAIN, self.policy_version)  # trainers loaded, engines asleep
            rollout_stats.update(self.logprobs(batch, rollout_stats["rollout/staleness"]))
        with timed(timings, "advantage"):
            metrics = self.compute_advantages(batch)
        with timed(timings, "train"):
            metrics.update(self.train(batch, step))
        self.policy_version = step + 1
        if self.queue is not None:
            if not self.policy_sync.streaming:  # a sync would queue behind the batches
                with timed(timings, "rollout_wait"):
                    self.queue.wait_for_sync()
            with timed(timings, "sync_after"):
                self._unreported_sync = self.sync_weights()
        metrics.update(rollout_stats)
        metrics.update(sync_metrics)
        colocation_s = self.colocation.pop_seconds() if self.colocation.active else None
        metrics.update(self.colocation.pop_memory())  # the roles' device memory (GPUs)
        add_step_totals(metrics, timings, batch, colocation_s)
        every = self.cfg.tracking.dump_rollouts_every
        if every and step % every == 0:
            dump_rollouts(self.out_dir, step + 1, batch, use_critic=self.use_critic)
        return metrics

    # --- phases ----------------------------------------------------------------------------

    @property
    def defers_parity(self) -> bool:
        """Whether the step's sync may leave the engines' side of the parity probe to the
        rollout's generate call: the synchronous loop on vLLM engines (``PolicySync`` keeps it
        where the roles are colocated)."""
        return (
            self.queue is None
            and isinstance(self.rollouts, RolloutPhase)
            and self.cfg.actor_infer.strategy_args.strategy_name == "vllm"
        )

    def sync_weights(self, *, defer_parity: bool = False) -> dict[str, float]:
        """The trainer's policy into the rollout engines, then the parity probe (``sync/*``
        metrics; empty when the engines already serve the trainer's version). ``defer_parity``:
        the probe's metrics come with the rollout (``PolicySync.finish_parity``)."""
        return self.policy_sync.sync(self.policy_version, defer_parity=defer_parity)

    def logprobs(self, batch: Batch, staleness: float) -> dict[str, float]:
        """Fill ``old_logprobs``, ``ref_logprobs`` (kl_coef > 0) and the critic's ``values``."""
        reuse = reuse_rollout_logprobs(
            self.cfg, staleness=staleness, last_parity=self.policy_sync.last_parity
        )
        return fill_logprobs(
            batch,
            self.clusters,
            reuse=reuse,
            use_critic=self.use_critic,
            kl_coef=self.cfg.algorithm.kl_coef,
            in_train_step=old_logprobs_in_train_step(self.cfg),
        )

    def compute_advantages(self, batch: Batch) -> dict[str, float]:
        """Add ``advantages`` (and the critic's ``returns``) to ``batch``; returns metrics."""
        columns, metrics = batch_advantages(
            self.cfg.algorithm, batch.tensors, self.cfg.num_return_sequences_in_group
        )
        batch.tensors.update(columns)
        return metrics

    def train(self, batch: Batch, step: int) -> dict[str, float]:
        """``algorithm.ppo_epochs`` passes of actor training over ``batch`` (and of the critic's,
        side by side). Metrics: the actor's unprefixed (``grad_norm``, ``lr``, ...) as the loss
        names them, the critic's under ``critic/``."""
        jobs = {"actor_train": (TRAIN_KEYS, self.loss_fn)}
        if self.use_critic:
            jobs["critic"] = (CRITIC_KEYS, self.value_loss_fn)
        seed = step_seed(self.cfg.seed, step, 0)
        balance = {  # roles cutting micro-batches by tokens get rows dealt to ranks by tokens
            name: role.training_args.per_device_train_batch_size
            * role.training_args.gradient_accumulation_steps
            for name in jobs
            if (role := getattr(self.cfg, name)).max_tokens_per_micro_batch is not None
        }
        fill_old = "old_logprobs" not in batch  # the log-prob phase left them to this step
        metrics = train_passes(
            self.clusters,
            batch,
            jobs,
            ppo_epochs=self.cfg.algorithm.ppo_epochs,
            seed=seed,
            balance=balance,
            fill_old_logprobs=fill_old,
        )
        if fill_old:
            metrics.update(mismatch_metrics(batch))
        return metrics

    # --- evaluation and checkpoints --------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy (and, with ``validation.num_samples``, mean@k / pass@k) of the
        trainer's current policy on the held-out rows, per domain; see
        ``roll_ds/pipeline/eval_metrics.py``. The rollout engines are synced first if they lag
        (the next step then reports that sync's metrics)."""
        self._unreported_sync.update(self.sync_weights())
        self.colocation.enter(GENERATE, self.policy_version)
        return evaluate_policy(
            self.actor_infer, self.rollouts.score, self.tokenizer, self.eval_rows, self.cfg
        )

    def save_checkpoint(self, step: int, metrics: dict[str, float] | None = None) -> Path:
        """Save checkpoint ``step``; with ``save_best``, keep it as ``checkpoints/best`` too if
        ``metrics`` (this step's, eval included) hold the best value so far."""
        cfg = self.cfg
        self.colocation.enter(TRAIN, self.policy_version)  # engine states back on their GPUs
        final = save_run_checkpoint(
            step,
            cfg=cfg,
            checkpoints=self.checkpoints,
            clusters=self.clusters,
            roles=self._trained_roles,
            sampler=self.sampler,
            queue=self.queue,
            model_dir=self.model_dir,
        )
        if cfg.save_best:
            if self.best is None:  # a resumed run goes on from its record
                resume = bool(cfg.resume_from_checkpoint)
                root = self.checkpoints.root
                self.best = BestCheckpoint(root, cfg.save_best, cfg.save_best_mode, resume=resume)
            self.best.offer(final, step, metrics or {})
        if cfg.export.every_save:
            self.exported = export_run_step(self.actor_train, self.out_dir, step)
        return final

    def _maybe_resume(self) -> int:
        """The step to start from: 0, or that of ``resume_from_checkpoint`` once loaded."""
        if not self.cfg.resume_from_checkpoint:
            return 0
        step = resume_run(
            self.cfg.resume_from_checkpoint,
            checkpoints=self.checkpoints,
            clusters=self.clusters,
            roles=self._trained_roles,
            sampler=self.sampler,
            queue=self.queue,
            out_dir=self.out_dir,
        )
        self.policy_version = step
        return step
