"""The RL loop. One step reads like DESIGN.md's step list:

    sync -> rollout (episodes, scores) -> log-probs -> advantages -> train -> log / checkpoint

Every task is an environment (``tasks.py``): a dataset row is one of a single turn, scored by the
reward roles; a ``custom_envs`` environment one of many turns; a step may mix both. With a critic
estimator (gae) the critic computes the rollout's values in the log-prob phase, the advantage
phase turns them into advantages and returns, and the critic trains beside the actor.
``async_generation.max_staleness: 0`` is the synchronous case of the one rollout path: above 0
the next steps play ahead in driver threads while this one trains (``rollout_queue.py``).

Everything that can fail on bad input (model path, data files, environments, domain routing) is
checked in ``__init__``, before any Ray actor starts; ``start()`` brings the roles up.

The phases: ``policy_sync`` (weights into the engines, parity), ``rollout_phase`` (play, score,
dynamic sampling, the async queue), ``logprobs``, ``batch_advantages``, ``passes`` (PPO epochs),
``save_resume`` (checkpoints), ``reporting`` (timings, tracker, curves); the losses shipped to
the trainers are ``loss_fns``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from roll_ds import timeline
from roll_ds.algorithms.turns import per_turn_advantages
from roll_ds.checkpoint import LATEST, BestCheckpoint, CheckpointManager
from roll_ds.config.estimators import needs_critic
from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.batch import Batch
from roll_ds.export import export_run_step, hf_step_dir
from roll_ds.models.shipped import resolve_pretrain
from roll_ds.pipeline.batch_advantages import batch_advantages, mismatch_metrics
from roll_ds.pipeline.colocation.choreography import GENERATE, TRAIN, Choreography
from roll_ds.pipeline.colocation.plan import ColocationPlan
from roll_ds.pipeline.engines import RolloutEngines
from roll_ds.pipeline.evaluation import evaluate_policy
from roll_ds.pipeline.faults import MainThreadRestore, call_bounds, watch_stateless
from roll_ds.pipeline.logprobs import OldLogprobs, fill_logprobs
from roll_ds.pipeline.loss_fns import CRITIC_KEYS, TRAIN_KEYS, PolicyLoss, ValueLoss
from roll_ds.pipeline.model_roles import ModelRole, role_handles
from roll_ds.pipeline.passes import train_passes
from roll_ds.pipeline.policy_sync import PolicySync
from roll_ds.pipeline.reporting import (
    add_step_totals,
    dump_rollouts,
    open_tracker,
    plot_run_curves,
    progress_postfix,
    timed,
)
from roll_ds.pipeline.restarts import TrainerRestarts
from roll_ds.pipeline.rollout_phase import RolloutPhase
from roll_ds.pipeline.rollout_queue import RolloutQueue
from roll_ds.pipeline.save_resume import (
    check_resume,
    checkpoint_run_id,
    resume_run,
    save_run_checkpoint,
)
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
from roll_ds.pipeline.startup_report import StartupReport
from roll_ds.pipeline.tasks import Tasks
from roll_ds.threads import driver_threads
from roll_ds.tracking import ROLLOUTS_FILE, Tracker

logger = logging.getLogger(__name__)


class RLVRPipeline:
    """The loop over the roles' actors. ``cfg`` has passed ``roll_ds.config.validate`` (the
    entry points validate before building this), so names, modes and roles are not re-checked."""

    def __init__(self, cfg: RLVRConfig, *, faults: TrainerRestarts | None = None) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        # The restarts of this run so far (launch.run_pipeline's): faults/* in each logged row.
        self.faults = faults if faults is not None else TrainerRestarts(cfg)
        self.out_dir = Path(cfg.output_dir) / cfg.exp_name
        algo = cfg.algorithm
        ahead = cfg.async_generation.max_staleness
        self.queue = RolloutQueue(ahead) if ahead else None
        self.loss_fn = PolicyLoss.from_config(algo, cfg.response_length, played_ahead=bool(ahead))
        self.use_critic = needs_critic(algo.adv_estimator)
        self.value_loss_fn = (
            ValueLoss.from_config(algo, cfg.response_length) if self.use_critic else None
        )
        self.old_logprobs = OldLogprobs.from_config(cfg)
        # Data and environments first: malformed rows and environments are reported before the
        # model is loaded or any actor starts.
        self.startup = StartupReport()  # the start-up profile (startup.json)
        with timeline.phase("tokenizer and tasks"):
            self.model_dir = resolve_pretrain(cfg.pretrain)
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self.tasks = Tasks.load(cfg, self.tokenizer)
        self.checkpoints = CheckpointManager(self.out_dir / "checkpoints", keep_last=cfg.keep_last)
        # A missing or partial checkpoint fails before any actor starts (`latest` with none yet
        # is a fresh start: _maybe_resume).
        if cfg.resume_from_checkpoint and not self._fresh_latest():
            check_resume(cfg, self.checkpoints, self._trained_roles)
        self.best: BestCheckpoint | None = None  # save_best: the first save sets it up
        self.exported: Path | None = None  # the latest Hugging Face export
        self.resumed = False  # run() loaded a checkpoint (resume_from_checkpoint)
        self.run_id: str | None = None  # the tracker's run id, kept in every checkpoint
        self.clusters: dict[str, Any] = {}
        self.roles: dict[str, ModelRole] = {}  # typed handles of the model roles' clusters
        # The trainer's weight version: the number of train steps taken (the engines' is
        # policy_sync.rollout_version).
        self.policy_version = 0
        self.colocation = Choreography(ColocationPlan())  # start() plans it from the placement
        self.env_pool: Any = None
        self.rollouts: RolloutPhase | None = None  # start() builds the phases over the roles
        self.policy_sync: PolicySync | None = None
        self.recovery: Any = None  # start(): replaces dead ranks of stateless roles (faults.py)
        self.engine_restore: MainThreadRestore | None = None
        self._threads_before: int | None = None  # the caller's torch threads, for shutdown

    # --- start-up --------------------------------------------------------------------------

    def start(self, *, eval_only: bool = False, connection: Future | None = None) -> None:
        """Start every role's actors. ``eval_only`` (``python -m roll_ds.evaluate``): only the
        rollout engines and the reward roles, serving the loaded model as the current policy.
        ``connection``: a Ray connection under way (``ray_init.connect_in_background``)."""
        from roll_ds.distributed.ray_init import connect_from_config

        cfg = self.cfg
        if self._threads_before is None:  # the driver's own tensors: one thread (threads.py)
            self._threads_before = driver_threads()
        with timeline.phase("ray.init" if connection is None else "wait for ray.init"):
            self.ray = connection.result() if connection is not None else connect_from_config(cfg)
        logger.info(self.ray.summary())
        with timeline.phase("placement"):
            self.resources = reserve_resources(cfg, eval_only=eval_only)
        roles = model_roles(cfg, use_critic=self.use_critic, eval_only=eval_only)
        ctx = strategy_context(cfg, self.model_dir, self.tokenizer)
        create_clusters(
            self.clusters, cfg, roles, self.resources, ctx, self._trained_roles, self.startup
        )
        device_resource = self.resources.plan.device_resource
        self.colocation = choreography(
            cfg, self.clusters, device_resource, self.out_dir, eval_only=eval_only
        )
        initialize_roles(self.clusters, self.colocation, [*roles, *reward_roles(cfg)], self.startup)
        # Every worker is up and idle: the /dev/shm files its libraries made are there now, and
        # recorded even if the worker dies later (distributed/shm.py: the sweep at shutdown).
        for cluster in self.clusters.values():
            cluster.record_shm()
        self.roles = role_handles(self.clusters)
        if cfg.train_env_manager.tags or cfg.val_env_manager.tags:
            from roll_ds.agentic.env_pool import RayEnvPool

            self.env_pool = RayEnvPool(
                self.tasks.env_types(),
                cfg.agentic.step_timeout_s,
                cfg.agentic.num_env_workers,
                max_restarts=cfg.fault_tolerance.max_restarts,
            )
        engines = RolloutEngines(self.clusters["actor_infer"], call_bounds(cfg))
        self.policy_sync = PolicySync(
            cfg,
            self.clusters.get("actor_train"),
            engines,
            self.colocation,
            self.tasks.probe_prompts,
            pad_token_id(self.tokenizer),
        )
        self.rollouts = RolloutPhase(
            cfg=cfg,
            engines=engines,
            clusters=self.clusters,
            colocation=self.colocation,
            tasks=self.tasks,
            tokenizer=self.tokenizer,
            pool=self.env_pool,
            queue=self.queue,
            parity=self.policy_sync,
        )
        # A replaced engine gets the trainer's current weights, synced on the main thread
        # (a rollout thread that replaced one waits for it there: faults.py).
        self.engine_restore = MainThreadRestore(
            lambda cluster, ranks: self.policy_sync.restore_engines(
                cluster, ranks, version=self.policy_version
            )
        )
        self.recovery = watch_stateless(cfg, self.clusters, self.colocation, self.engine_restore)
        self.recovery.idle = self.engine_restore.serve
        if self.queue is not None:
            self.queue.idle = self.engine_restore.serve
        if eval_only:  # no trainer to sync from: the engines serve the policy under evaluation
            self.policy_sync.rollout_version = self.policy_version

    def shutdown(self) -> None:
        """Stop every role's actors and give their placement groups back, so the same Ray
        session can start another pipeline (benchmarks and tests do); nothing of the run is
        left: the workers close first (their engines and process groups unlink their shared
        memory), are then killed, and the /dev/shm files a dead or stuck worker left are
        swept (``roll_ds/distributed/teardown.py``)."""
        from roll_ds.distributed.teardown import shutdown_clusters

        if self.engine_restore is not None:  # a rollout thread waiting on it ends
            self.engine_restore.close()
        if self.rollouts is not None:
            self.rollouts.close()
        if self.env_pool is not None:
            self.env_pool.shutdown()
            self.env_pool = None
        shutdown_clusters(list(self.clusters.values()))
        self.clusters, self.roles = {}, {}
        resources = getattr(self, "resources", None)
        if resources is not None:
            resources.release()
            self.resources = None
        if self._threads_before is not None:  # the caller's thread count back
            driver_threads(self._threads_before)
            self._threads_before = None

    @property
    def actor_train(self):
        return self.clusters["actor_train"]

    @property
    def actor_infer(self):
        return self.clusters["actor_infer"]

    @property
    def _trained_roles(self) -> list[str]:
        """Roles that train every step (their engines are in every checkpoint)."""
        return ["actor_train", "critic"] if self.use_critic else ["actor_train"]

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        cfg = self.cfg
        start_step = self._maybe_resume()
        self.faults.resumed()  # after a restart: back where the failed attempt had got to
        if start_step == 0:  # a fresh run: an earlier run's rollout dumps are not ours
            (self.out_dir / ROLLOUTS_FILE).unlink(missing_ok=True)
        tracker = self._open_tracker(start_step)
        bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps)
        try:
            if start_step == 0 and cfg.eval_steps:
                with timeline.phase("step-0 evaluation"):
                    tracker.log({**self.evaluate(), **self.faults.metrics()}, step=0)
            for step in bar:
                with timeline.phase(f"step {step + 1}"):
                    metrics = self.train_one_step(step)
                if step == start_step:
                    self.startup.write(self.out_dir, end=time.time())
                done = step + 1
                if cfg.eval_steps and (done % cfg.eval_steps == 0 or done == cfg.max_steps):
                    metrics.update(self.evaluate())
                if done % max(cfg.logging_steps, 1) == 0 or done == cfg.max_steps:
                    tracker.log({**metrics, **self.faults.metrics()}, step=done)
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
        """One step: sync -> rollout -> log-probs -> advantages -> train."""
        timings: dict[str, float] = {}
        if self.queue is not None and not self.policy_sync.streaming:
            with timed(timings, "rollout_wait"):  # mode batch: the steps in flight finish first
                self.queue.wait_for_sync()
        with timed(timings, "sync"):
            metrics = self.sync_weights(before_rollout=True)
        with timed(timings, "rollout"):
            batch, rollout_stats = self.rollouts.step_batch(
                step,
                policy_version=self.policy_version,
                rollout_version=self.policy_sync.rollout_version,
            )
            metrics.update(self.policy_sync.pop_metrics())  # a parity check the rollout finished
        with timed(timings, "logprobs"):
            self.colocation.enter(TRAIN, self.policy_version)  # trainers loaded, engines asleep
            rollout_stats.update(self.logprobs(batch, rollout_stats["rollout/staleness"]))
        with timed(timings, "advantage"):
            metrics.update(self.compute_advantages(batch))
        with timed(timings, "train"):
            metrics.update(self.train(batch, step))
        self.policy_version = step + 1
        metrics.update(rollout_stats)
        if self.recovery is not None:  # faults/<role>/*: ranks replaced
            metrics.update(self.recovery.pop_metrics())
        if self.env_pool is not None:  # faults/env_hosts/*: hosts the pool replaced itself
            metrics.update(self.env_pool.pop_metrics())
        colocation_s = self.colocation.pop_seconds() if self.colocation.active else None
        metrics.update(self.colocation.pop_memory())  # the roles' device memory (GPUs)
        add_step_totals(metrics, timings, batch, colocation_s)
        every = self.cfg.tracking.dump_rollouts_every
        if every and step % every == 0:
            dump_rollouts(self.out_dir, step + 1, batch, use_critic=self.use_critic)
        return metrics

    # --- phases ----------------------------------------------------------------------------

    def sync_weights(self, *, before_rollout: bool = False) -> dict[str, float]:
        """The trainer's policy into the rollout engines (``sync/*`` metrics; empty when they
        serve it already). ``mode: batch`` waits for the steps in flight first, so each step
        is generated by the weights it started with."""
        if self.queue is not None and not self.policy_sync.streaming:
            self.queue.wait_for_sync()
        return self.policy_sync.sync(self.policy_version, before_rollout=before_rollout)

    def logprobs(self, batch: Batch, staleness: float) -> dict[str, float]:
        """Fill ``old_logprobs``, ``ref_logprobs`` (kl_coef > 0) and the critic's ``values``."""
        old = self.old_logprobs
        return fill_logprobs(
            batch,
            self.roles,
            reuse=old.reuse(staleness=staleness, last_parity=self.policy_sync.last_parity),
            use_critic=self.use_critic,
            kl_coef=self.cfg.algorithm.kl_coef,
            in_train_step=old.in_train_step,
        )

    def compute_advantages(self, batch: Batch) -> dict[str, float]:
        """Add ``advantages`` (and the critic's ``returns``) to ``batch``; returns metrics.
        ``agentic.reward_mode: per_turn``: each turn's discounted return instead of the
        episode's (environment episodes)."""
        cfg = self.cfg
        group = cfg.num_return_sequences_in_group
        columns, metrics = batch_advantages(cfg.algorithm, batch.tensors, group)
        if cfg.agentic.reward_mode == "per_turn" and "turn_returns" in batch:
            columns["advantages"] = per_turn_advantages(
                batch["turn_returns"], batch["scores"], batch["response_mask"], group
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
            self.roles,
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
        """The held-out tasks played by the trainer's current policy (``evaluation.py``): the
        engines are synced first if they lag (that sync's metrics as ``eval/sync/*``)."""
        with timeline.phase("evaluation: sync"):  # the start-up profile's step 0
            # the parity probe rides on the evaluation's first generate call, as on a step's
            # rollout (parity mode on_rollout): no engine pass of its own after the sync
            synced = self.sync_weights(before_rollout=True)
        self.colocation.enter(GENERATE, self.policy_version)
        with timeline.phase("evaluation: play and score"):
            metrics = evaluate_policy(self.rollouts)
        synced.update(self.policy_sync.pop_metrics())
        metrics.update({f"eval/{k}": v for k, v in synced.items()})
        return metrics

    def save_checkpoint(self, step: int, metrics: dict[str, float] | None = None) -> Path:
        """Save checkpoint ``step``; with ``save_best``, keep it as ``checkpoints/best`` too if
        ``metrics`` (this step's, eval included) hold the best value so far."""
        cfg = self.cfg
        self.colocation.enter(TRAIN, self.policy_version)  # engine states back on their GPUs
        final = save_run_checkpoint(
            step,
            cfg=cfg,
            checkpoints=self.checkpoints,
            trainers=self.roles,
            roles=self._trained_roles,
            sampler=self.tasks.sampler,
            queue=self.queue,
            model_dir=self.model_dir,
            run_id=self.run_id,
        )
        self.faults.progress()  # a failure from here on loses only what follows
        if cfg.save_best:
            if self.best is None:  # a resumed run goes on from its record
                root, mode = self.checkpoints.root, cfg.save_best_mode
                self.best = BestCheckpoint(root, cfg.save_best, mode, resume=self.resumed)
            self.best.offer(final, step, metrics or {})
        if cfg.export.every_save:
            self.exported = export_run_step(self.actor_train, self.out_dir, step)
        return final

    def _open_tracker(self, start_step: int) -> Tracker:
        """The run's tracker, under the run id its checkpoint kept, else that of an earlier
        attempt of this run (an automatic restart), else a new one."""
        run_id = self.run_id or self.faults.run_id
        tracker = open_tracker(self.cfg, self.out_dir, start_step, run_id)
        self.run_id = self.faults.run_id = tracker.run_id
        return tracker

    def _fresh_latest(self) -> bool:
        """``resume_from_checkpoint=latest`` with no checkpoint written yet."""
        return self.cfg.resume_from_checkpoint == LATEST and self.checkpoints.latest() is None

    def _maybe_resume(self) -> int:
        """The step to start from: 0, or that of ``resume_from_checkpoint`` once loaded.
        ``latest`` with no checkpoint yet starts at step 0: a job a scheduler requeues runs
        the same command line at its first start and after (docs/cluster.md)."""
        which = self.cfg.resume_from_checkpoint
        if not which:
            return 0
        if self._fresh_latest():
            logger.warning(
                "resume_from_checkpoint=latest: no checkpoint under %s yet; starting at step 0",
                self.checkpoints.root,
            )
            return 0
        step = resume_run(
            which,
            checkpoints=self.checkpoints,
            trainers=self.roles,
            roles=self._trained_roles,
            sampler=self.tasks.sampler,
            queue=self.queue,
            out_dir=self.out_dir,
        )
        self.resumed = True
        self.run_id = checkpoint_run_id(self.checkpoints, which)
        self.policy_version = step
        return step
