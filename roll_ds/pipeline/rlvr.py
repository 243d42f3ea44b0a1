"""The RLVR loop. One step reads like DESIGN.md's step list:

    weights -> rollout -> reward -> filter -> logprob -> advantage -> train -> log / checkpoint

With a critic estimator (gae) the critic role computes the rollout's values in the logprob phase,
the advantage phase turns them into advantages and returns, and the critic trains on the returns
beside the actor.

Everything that can fail on bad input (model path, data files, domain routing, algorithm names)
is checked in ``__init__``, before any Ray actor starts; ``start()`` brings the roles up.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from roll_ds.algorithms.advantages import ADVANTAGE_ESTIMATORS
from roll_ds.algorithms.aggregation import AGG_MODES
from roll_ds.algorithms.kl import KL_ESTIMATORS
from roll_ds.algorithms.masks import overlong_soft_penalty
from roll_ds.checkpoint import (
    BestCheckpoint,
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
)
from roll_ds.config.estimators import needs_critic
from roll_ds.config.schema import RLVRConfig
from roll_ds.data.prompts import prompt_token_ids
from roll_ds.data.sampler import PromptSampler
from roll_ds.data.sources import load_rows
from roll_ds.distributed.batch import Batch, object_array
from roll_ds.export import ExportInfo, export_run_step, hf_step_dir
from roll_ds.models.embedded import resolve_pretrain
from roll_ds.pipeline.advantage import batch_advantages
from roll_ds.pipeline.colocation import (
    GENERATE,
    SYNC,
    TRACE_FILE,
    TRAIN,
    Choreography,
    ColocationPlan,
    cluster_runner,
    colocated_parity,
    plan_colocation,
)
from roll_ds.pipeline.evaluation import evaluate_policy
from roll_ds.pipeline.losses import PolicyLoss, ValueLoss
from roll_ds.pipeline.passes import merge_pass_metrics, pass_orders, schedule_steps
from roll_ds.pipeline.rollout import (
    domain_metrics,
    domain_routes,
    fit_dynamic_batch,
    group_has_signal,
)
from roll_ds.pipeline.rollout_queue import InFlight, RolloutQueue
from roll_ds.pipeline.sequences import pack_sequences, scatter_response_values
from roll_ds.threads import role_threads
from roll_ds.tracking import (
    ROLLOUTS_FILE,
    Tracker,
    plot_curves,
    read_metrics,
    truncate_jsonl_after,
)
from strategies.base import StrategyContext

logger = logging.getLogger(__name__)
# What the training workers need of a batch (the loss reads these columns).
TRAIN_KEYS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "loss_mask",
    "old_logprobs",
    "advantages",
    "ref_logprobs",
    "rollout_logprobs",
)
# What the critic's workers need (ValueLoss reads these columns).
CRITIC_KEYS = ("input_ids", "attention_mask", "response_mask", "values", "returns")


@contextmanager
def timed(timings: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - start


class RLVRPipeline:
    def __init__(self, cfg: RLVRConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.out_dir = Path(cfg.output_dir) / cfg.exp_name
        algo = cfg.algorithm
        ADVANTAGE_ESTIMATORS.check(algo.adv_estimator)
        KL_ESTIMATORS.check(algo.kl_estimator)
        AGG_MODES.check(algo.loss_agg_mode)
        self.queue = (
            RolloutQueue(cfg.async_generation.max_staleness)
            if cfg.async_generation.max_staleness
            else None
        )
        if self.queue is not None and algo.tis_cap is None:  # async: correct for stale rollouts
            algo = replace(algo, tis_cap=ASYNC_TIS_CAP)
        self.loss_fn = PolicyLoss.from_config(algo, cfg.response_length)
        self.use_critic = needs_critic(algo.adv_estimator)
        if self.use_critic and cfg.critic is None:
            raise ValueError(
                f"algorithm.adv_estimator {algo.adv_estimator!r} needs a critic role; configure "
                "`critic:` (see examples/qwen_rlvr/rlvr_ppo_gae_zero3.yaml)"
            )
        self.value_loss_fn = (
            ValueLoss.from_config(algo, cfg.response_length) if self.use_critic else None
        )

        # Data first: malformed rows are reported before the model is built or loaded.
        self.train_rows = self._load_rows(cfg.actor_train.data_args)
        self.eval_rows = self._load_rows(cfg.validation.data_args)
        if cfg.validation.max_prompts:
            self.eval_rows = self.eval_rows[: cfg.validation.max_prompts]
        self.model_dir = resolve_pretrain(cfg.pretrain)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.train_rows = self._encode(self.train_rows, cfg.actor_train.data_args, "actor_train")
        self.eval_rows = self._encode(self.eval_rows, cfg.validation.data_args, "validation")
        domains = {r["domain"] for r in self.train_rows + self.eval_rows}
        self.routes = domain_routes(
            sorted(domains), {name: r.tag_included for name, r in cfg.rewards.items()}
        )
        self.sampler = PromptSampler(
            self.train_rows,
            seed=cfg.seed,
            domain_probs=dict(cfg.actor_train.data_args.domain_interleave_probs),
        )
        self.checkpoints = CheckpointManager(self.out_dir / "checkpoints", keep_last=cfg.keep_last)
        self.clusters: dict[str, Any] = {}
        # Weight versions: the trainer's is the number of train steps taken; the rollout
        # engines' is the version they last received (None: never synced).
        self.policy_version = 0
        self.rollout_version: int | None = None
        self._unreported_sync: dict[str, float] = {}
        self.last_parity: float | None = None  # max |delta| of the latest parity probe
        self._row_index = {id(row): i for i, row in enumerate(self.train_rows)}
        self.colocation = Choreography(ColocationPlan())  # start() plans it from the placement

    @staticmethod
    def _load_rows(data_args: Any) -> list[dict]:
        rows = load_rows(data_args)
        return rows[: data_args.max_samples] if data_args.max_samples else rows

    def _encode(self, rows: list[dict], data_args: Any, where: str) -> list[dict]:
        """Tokenize every prompt; prompts over ``prompt_length`` fail the start, or are dropped
        (and counted in the log) with ``data_args.filter_overlong_prompts``."""
        limit = self.cfg.prompt_length
        for row in rows:
            row["prompt_ids"] = prompt_token_ids(self.tokenizer, row, data_args, where)
        too_long = [row["id"] for row in rows if len(row["prompt_ids"]) > limit]
        if not too_long:
            return rows
        if not data_args.filter_overlong_prompts:
            raise ValueError(
                f"{where}.data_args: {len(too_long)} prompt(s) exceed prompt_length={limit} "
                f"tokens (e.g. {too_long[:3]}); raise prompt_length, shorten the prompts, or set "
                f"{where}.data_args.filter_overlong_prompts=true to drop them"
            )
        kept = [row for row in rows if len(row["prompt_ids"]) <= limit]
        logger.warning(
            "%s.data_args.filter_overlong_prompts: dropped %d of %d prompts over prompt_length=%d "
            "tokens (e.g. %s)",
            where,
            len(too_long),
            len(rows),
            limit,
            too_long[:3],
        )
        if not kept:
            raise ValueError(
                f"{where}.data_args: every prompt exceeds prompt_length={limit} tokens; raise "
                "prompt_length"
            )
        return kept

    # --- start-up --------------------------------------------------------------------------

    def start(self, *, eval_only: bool = False) -> None:
        """Start every role's actors. ``eval_only`` (``python -m roll_ds.evaluate``): only the
        rollout engines and the reward roles, serving the loaded model as the current policy."""
        from roll_ds.distributed.cluster import Cluster
        from roll_ds.distributed.ray_init import connect_from_config
        from roll_ds.distributed.resource_manager import ResourceManager
        from roll_ds.pipeline.workers import (
            ActorTrainWorker,
            CriticWorker,
            RewardWorker,
            RolloutWorker,
            StrategyWorker,
        )

        cfg = self.cfg
        self.ray = connect_from_config(cfg)
        logger.info(self.ray.summary())
        rewards = [f"rewards.{name}" for name in cfg.rewards]
        only = ["actor_infer", *rewards] if eval_only else None
        self.resources = ResourceManager.from_config(cfg, roles=only).reserve()
        eos = self.tokenizer.eos_token_id
        ctx = StrategyContext(
            pretrain=self.model_dir,
            seed=cfg.seed,
            max_steps=cfg.max_steps,
            response_length=cfg.response_length,
            stop_token_ids=(eos,) if eos is not None else (),
            logprob_temperature=rollout_temperature(cfg),
        )
        threads = role_threads(
            cfg, on_cuda=self.resources.plan.device_resource == "GPU", plan=self.resources.plan
        )
        logger.info("threads per actor: %s", threads)
        roles = {"actor_train": ActorTrainWorker, "actor_infer": RolloutWorker}
        if cfg.reference is not None:
            roles["reference"] = StrategyWorker
        if self.use_critic:
            roles["critic"] = CriticWorker
        if eval_only:
            roles = {"actor_infer": RolloutWorker}
        for name, cls in roles.items():
            role_cfg = getattr(cfg, name)
            role_ctx = ctx
            if name in self._trained_roles:  # the LR schedule spans all its optimizer steps
                role_ctx = replace(ctx, max_steps=schedule_steps(cfg, name))
            if name == "actor_infer" and cfg.weight_sync.lora_sync == "adapter":
                role_ctx = replace(ctx, adapter_sync_rank=cfg.actor_train.model_args.lora_rank)
            self.clusters[name] = Cluster(
                name,
                cls,
                self.resources,
                init_args=(role_cfg, role_ctx),
                env=role_cfg.system_envs,
                num_threads=threads.get(name),
            )
        for name, reward_cfg in cfg.rewards.items():
            self.clusters[f"rewards.{name}"] = Cluster(
                f"rewards.{name}",
                RewardWorker,
                self.resources,
                init_args=(reward_cfg, ctx),
                env=reward_cfg.system_envs,
                num_threads=threads.get(f"rewards.{name}"),
            )
        # Evaluation alone has no trainer to take turns with.
        plan = (
            ColocationPlan()
            if eval_only
            else plan_colocation(cfg, self.resources.plan.device_resource)
        )
        self.colocation = Choreography(
            plan,
            run=cluster_runner(self.clusters),
            trace_path=self.out_dir / TRACE_FILE,
        )
        # Roles that share the rollout engines' GPUs start after them (colocation.py: why).
        for stage in self.colocation.start_stages([*roles, *rewards]):  # rewards load meanwhile
            pending = [self.clusters[n].submit("initialize") for n in stage]
            for call in pending:
                call.get()
            self.colocation.started(stage)
        if eval_only:  # no trainer to sync from: the engines serve the policy under evaluation
            self.rollout_version = self.policy_version

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
        cfg = self.cfg
        start_step = self._maybe_resume()
        if start_step == 0:  # a fresh run: an earlier run's rollout dumps are not ours
            (self.out_dir / ROLLOUTS_FILE).unlink(missing_ok=True)
        tracker = Tracker(
            self.out_dir,
            tensorboard=cfg.tracking.tensorboard,
            jsonl=cfg.tracking.jsonl,
            wandb_project=cfg.tracking.wandb_project,
            run_name=cfg.exp_name,
            config=asdict(cfg),
            resume_step=start_step,
        )
        from tqdm import tqdm

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
                bar.set_postfix(_postfix(metrics))
                if cfg.save_steps and done % cfg.save_steps == 0:
                    self.save_checkpoint(done, metrics)
        finally:
            tracker.close()
        rows = read_metrics(self.out_dir / "metrics.jsonl")
        plot_curves(
            rows,
            [
                "rollout/score",
                "rollout/accuracy",
                "eval/accuracy",
                "actor/pg_loss",
                "critic/value_loss",
            ],
            self.out_dir / "curves.png",
        )
        last = getattr(self, "exported", None)  # every_save may have exported this step
        if cfg.export.at_end and last != hf_step_dir(self.out_dir, cfg.max_steps):
            self.colocation.enter(TRAIN, self.policy_version)
            self.exported = export_run_step(self.actor_train, self.out_dir, cfg.max_steps)
        return rows

    def train_one_step(self, step: int) -> dict[str, float]:
        """One step: weights -> rollout -> reward -> logprob -> advantage -> train. Under
        ``async_generation`` the rollout is the batch generated ahead (``rollout_queue``) while
        the next ones generate beside the training, and the new weights reach the engines at
        the end of the step, between generation batches."""
        timings: dict[str, float] = {}
        with timed(timings, "sync"):
            sync_metrics = self.sync_weights()
        sync_metrics = {**self._unreported_sync, **sync_metrics}
        self._unreported_sync = {}
        with timed(timings, "rollout"):
            batch, rollout_stats = self._rollout(step)
        with timed(timings, "logprobs"):
            self.colocation.enter(TRAIN, self.policy_version)  # trainers loaded, engines asleep
            staleness = rollout_stats["rollout/staleness"]
            rollout_stats.update(self._logprobs(batch, staleness=staleness))
        with timed(timings, "advantage"):
            metrics = self.compute_advantages(batch)
        with timed(timings, "train"):
            metrics.update(self.train(batch, step))
        self.policy_version = step + 1
        if self.queue is not None:
            with timed(timings, "rollout_wait"):  # the trainer waits for the next batch
                self.queue.wait_next()
            with timed(timings, "sync_after"):
                self._unreported_sync = self.sync_weights()
        metrics.update(rollout_stats)
        metrics.update(sync_metrics)
        metrics.update(timings)
        metrics["time/step"] = sum(timings.values())
        if self.colocation.active:  # offload / sleep / wake calls, inside the phases' times
            metrics["colocation/seconds"] = self.colocation.pop_seconds()
        # End to end: per second of the whole step (generation may overlap training).
        step_s = max(metrics["time/step"], 1e-9)
        metrics["throughput/generated_tokens_per_s"] = float(batch["response_mask"].sum()) / step_s
        metrics["throughput/samples_per_s"] = len(batch) / step_s
        every = self.cfg.tracking.dump_rollouts_every
        if every and step % every == 0:
            self._dump_rollouts(step + 1, batch)
        return metrics

    def _rollout(self, step: int) -> tuple[Batch, dict[str, float]]:
        """This step's scored batch: generated now, or (async) taken from the queue after
        submitting the batches ``max_staleness`` steps ahead. Adds ``rollout/staleness``."""
        if self.queue is None:
            batch, stats = self.rollout_and_score(step)
            stats["rollout/staleness"] = 0.0
            return batch, stats
        self.queue.fill(step, self._submit_step)
        started = time.perf_counter()
        item = self.queue.take(step)
        waited = time.perf_counter() - started
        prompts = [self.train_rows[i] for i in item.rows]
        batch, stats = self.rollout_and_score(step, first=self._samples(prompts, item.output))
        stats["time/rollout_generate"] = waited  # the part of generation the step waited for
        stats["rollout/staleness"] = float(step - item.version)
        return batch, stats

    def _submit_step(self, step: int) -> InFlight:
        """Draw step ``step``'s prompts and start generating them with the engines' weights."""
        prompts = self.sampler.next_batch(self.cfg.rollout_batch_size)
        seed = _step_seed(self.cfg.seed, step, 0)
        assert self.rollout_version is not None, "the engines must be synced before generating"
        return InFlight(
            step=step,
            version=self.rollout_version,
            rows=[self._row_index[id(p)] for p in prompts],
            seed=seed,
            call=self._submit_generation(prompts, seed),
        )

    def _logprobs(self, batch: Batch, *, staleness: float) -> dict[str, float]:
        """Fill ``old_logprobs`` (recomputed, or the rollout's: ``algorithm.old_logprobs``),
        ``ref_logprobs`` (kl_coef > 0) and the critic's ``values``."""
        inputs = batch.select("input_ids", "attention_mask", meta=False)
        values = self.critic.submit("compute_values", inputs) if self.use_critic else None
        reuse = self._reuse_rollout_logprobs(staleness)
        if reuse:
            batch.tensors["old_logprobs"] = batch["rollout_logprobs"].clone()
        else:
            old = self.actor_train.compute_logprobs(inputs, key="old_logprobs")
            batch.tensors.update(old.tensors)
        if self.cfg.algorithm.kl_coef > 0:
            batch.tensors.update(self.reference_logprobs(inputs).tensors)
        if values is not None:
            batch.tensors.update(values.get().tensors)
        return {"actor/old_logprobs_recomputed": float(not reuse)}

    def _reuse_rollout_logprobs(self, staleness: float) -> bool:
        """``algorithm.old_logprobs``: auto reuses the rollout's log-probs only where they are
        the trainer's numbers: an on-policy batch, fp32 on both sides, and the latest parity
        probe within ``AUTO_REUSE_PARITY``."""
        mode = self.cfg.algorithm.old_logprobs
        if mode != "auto":
            return mode == "rollout"
        dtypes = {self.cfg.actor_train.model_args.dtype, self.cfg.actor_infer.model_args.dtype}
        return (
            staleness == 0
            and dtypes == {"fp32"}
            and self.last_parity is not None
            and self.last_parity <= AUTO_REUSE_PARITY
        )

    def train(self, batch: Batch, step: int) -> dict[str, float]:
        """``algorithm.ppo_epochs`` passes of actor training over ``batch`` (and of the critic's,
        side by side). Metrics: the actor's unprefixed (``grad_norm``, ``lr``, ...) as the loss
        names them, the critic's under ``critic/``."""
        jobs = {"actor_train": (TRAIN_KEYS, self.loss_fn)}
        if self.use_critic:
            jobs["critic"] = (CRITIC_KEYS, self.value_loss_fn)
        parts = {
            name: batch.select(*[k for k in keys if k in batch], meta=False)
            for name, (keys, _) in jobs.items()
        }
        per_pass: dict[str, list[dict[str, float]]] = {name: [] for name in jobs}
        seed = _step_seed(self.cfg.seed, step, 0)
        for order in pass_orders(len(batch), self.cfg.algorithm.ppo_epochs, seed):
            calls = {
                name: self.clusters[name].submit("train_step", parts[name].index(order), loss_fn)
                for name, (_, loss_fn) in jobs.items()
            }
            for name, call in calls.items():
                per_pass[name].append(_mean_dicts(call.get()))
        metrics = merge_pass_metrics(per_pass["actor_train"])
        if self.use_critic:
            critic = merge_pass_metrics(per_pass["critic"])
            metrics.update({k if "/" in k else f"critic/{k}": v for k, v in critic.items()})
        return metrics

    def _dump_rollouts(self, step: int, batch: Batch) -> None:
        """One JSON row per sample; with a critic also its per-response-token ``values``,
        ``returns`` and ``advantages`` (to inspect what the critic learns)."""
        token_keys = ("values", "returns", "advantages") if self.use_critic else ()
        mask = batch["response_mask"] > 0
        self.out_dir.mkdir(parents=True, exist_ok=True)  # also when stepped without run()
        with open(self.out_dir / "rollouts.jsonl", "a") as f:
            for i in range(len(batch)):
                row = {
                    "step": step,
                    "id": batch["id"][i],
                    "domain": batch["domain"][i],
                    "response": batch["response_text"][i],
                    "score": float(batch["scores"][i]),
                }
                row.update({k: batch[k][i][mask[i]].tolist() for k in token_keys})
                f.write(json.dumps(row) + "\n")

    # --- phases ----------------------------------------------------------------------------

    def sync_weights(self) -> dict[str, float]:
        """Gather the policy's full weights from the ZeRO shards into every rollout engine (one
        reload each, prefix cache dropped), then check parity. Returns ``sync/*`` metrics:
        seconds, bytes, gbps, ... and ``sync/parity_max_abs_diff`` / ``_mean_abs_diff``; empty
        when the engines already serve the trainer's version."""
        if self.rollout_version == self.policy_version and not self.colocation.needs_sync:
            return {}
        metrics = self._sync_weights()
        self.rollout_version = self.policy_version
        return metrics

    def _sync_weights(self) -> dict[str, float]:
        from roll_ds.weight_sync.select import build_transport

        ws = self.cfg.weight_sync
        if getattr(self, "weight_transport", None) is None:  # built once, on the first sync
            self.weight_transport = build_transport(
                ws,
                self.actor_train,
                self.actor_infer,
                rollout_dtype=self.cfg.actor_infer.model_args.dtype,
            )
        self.colocation.enter(SYNC, self.policy_version)  # trainer loaded, engine weights awake
        metrics = self.weight_transport.sync(self.actor_train, self.actor_infer)
        self.colocation.synced(self.policy_version)
        self.last_parity = None
        if ws.parity_check:
            metrics.update(self._weight_parity(metrics))
            self.last_parity = metrics["sync/parity_max_abs_diff"]
        return metrics

    def _weight_parity(self, sync_metrics: dict[str, float]) -> dict[str, float]:
        """vLLM's vs the trainer's log-probs on the first ``parity_probe_size`` train prompts;
        a gap above ``weight_sync.parity_max_abs_diff`` (default: by dtype) stops the run."""
        from roll_ds.weight_sync.parity import check_parity, default_max_abs_diff, probe_batch

        ws, cfg = self.cfg.weight_sync, self.cfg
        if getattr(self, "parity_probe", None) is None:
            rows = [r["prompt_ids"] for r in self.train_rows if len(r["prompt_ids"]) >= 2]
            self.parity_probe = probe_batch(rows[: ws.parity_probe_size], self._pad_id())
        dtypes = (cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype)
        bound = ws.parity_max_abs_diff
        if bound is None:
            bound = default_max_abs_diff(*dtypes)
        what = (
            f"{int(sync_metrics.get('sync/num_tensors', 0))} tensors, trainer "
            f"{dtypes[0]} -> {self.actor_infer.name} {dtypes[1]}"
        )
        if self.colocation.active:  # the trainer scores, leaves the GPU, then the engines do
            return colocated_parity(
                self.actor_train,
                self.actor_infer,
                self.parity_probe,
                max_abs_diff=bound,
                what=what,
                between=lambda: self.colocation.enter(GENERATE, self.policy_version),
            )
        return check_parity(
            self.actor_train, self.actor_infer, self.parity_probe, max_abs_diff=bound, what=what
        )

    def rollout_and_score(
        self, step: int, first: Batch | None = None
    ) -> tuple[Batch, dict[str, float]]:
        """Generate (``first``: the samples already generated for round 0), score, shape and,
        with dynamic sampling, resample; returns the packed batch and ``rollout/*`` metrics."""
        cfg, algo = self.cfg, self.cfg.algorithm
        group = cfg.num_return_sequences_in_group
        kept: list[Batch] = []  # groups that train
        spare: list[Batch] = []  # dynamic sampling: groups without signal, padding if short
        kept_groups, drawn, rounds = 0, 0, 0
        stats: dict[str, float] = {"time/rollout_generate": 0.0, "time/rollout_reward": 0.0}
        while True:
            started = time.perf_counter()
            if first is not None and rounds == 0:
                samples = first
                drawn_now = len(samples) // group
            else:
                prompts = self.sampler.next_batch(cfg.rollout_batch_size)
                samples = self._generate(prompts, seed=_step_seed(cfg.seed, step, rounds))
                drawn_now = len(prompts)
            generated = time.perf_counter()
            self._score(samples)
            penalty = self._overlong_penalty(samples)
            stats["time/rollout_generate"] += generated - started
            stats["time/rollout_reward"] += time.perf_counter() - generated
            if rounds == 0:
                stats.update(self._rollout_metrics(samples))
                if penalty is not None:
                    stats["rollout/overlong_penalty"] = float(penalty.mean())
            drawn += drawn_now
            if not algo.dynamic_sampling:
                kept.append(samples)
                break
            signal_B = group_has_signal(samples["scores"], group).repeat_interleave(group)
            kept.append(samples.index(signal_B.nonzero().flatten()))
            spare.append(samples.index((~signal_B).nonzero().flatten()))
            kept_groups += int(signal_B.sum()) // group
            rounds += 1
            if kept_groups >= cfg.rollout_batch_size or rounds >= algo.max_resample_rounds:
                break
        padding = 0
        if algo.dynamic_sampling:
            stats["rollout/kept_group_fraction"] = kept_groups / max(drawn, 1)
            batch, padding = fit_dynamic_batch(kept, spare, group, cfg.rollout_batch_size)
            stats["rollout/padding_groups"] = padding / group
        else:
            batch = kept[0]
        packed = self._pack(batch)
        if padding:  # padding groups carry no signal: they stay out of the loss
            packed.tensors["loss_mask"][len(packed) - padding :] = 0.0
        return packed, stats

    def _generate(self, prompts: list[dict], seed: int) -> Batch:
        return self._samples(prompts, self._submit_generation(prompts, seed).get())

    def _submit_generation(self, prompts: list[dict], seed: int) -> Any:
        """Start ``n`` samples per prompt on the rollout engines; a pending call."""
        self.colocation.enter(GENERATE, self.policy_version)
        prompt_batch = Batch(
            non_tensors={
                "prompt_ids": [p["prompt_ids"] for p in prompts],
                "row": range(len(prompts)),
            }
        )
        return self.actor_infer.submit("generate", prompt_batch, seed=seed)

    def _samples(self, prompts: list[dict], out: Any) -> Batch:
        """The generation output ``out`` (``row``, ``response_ids``, ``rollout_logprobs``,
        ``finish_reason``) joined with its prompts' rows and decoded."""
        rows = [prompts[r] for r in out["row"]]
        text = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in out["response_ids"]]
        return Batch(
            non_tensors={
                "prompt_ids": [r["prompt_ids"] for r in rows],
                "prompt": [r["prompt"] for r in rows],
                "ground_truth": [r["ground_truth"] for r in rows],
                "domain": [r["domain"] for r in rows],
                "id": [r["id"] for r in rows],
                "response_ids": out["response_ids"],
                "response_text": text,
                "rollout_logprobs": out["rollout_logprobs"],
                "finish_reason": out["finish_reason"],
            }
        )

    def _score(self, samples: Batch) -> None:
        """Fill ``scores`` and ``reward_info`` by sending each domain to its reward role."""
        scores = torch.zeros(len(samples))
        infos: list[dict] = [{} for _ in range(len(samples))]
        domains = list(samples["domain"])
        calls = []
        for role in sorted(set(self.routes[d] for d in domains)):
            rows = [i for i, d in enumerate(domains) if self.routes[d] == role]
            cluster = self.clusters[f"rewards.{role}"]
            part = samples.index(rows).select("prompt", "ground_truth", "response_text")
            calls.append((rows, cluster.submit("score", part)))
        for rows, call in calls:
            out = call.get()
            scores[rows] = out["scores"]
            for i, info in zip(rows, out["reward_info"], strict=True):
                infos[i] = info
        samples.tensors["scores"] = scores
        samples.non_tensors["reward_info"] = object_array(infos)

    def _overlong_penalty(self, samples: Batch) -> torch.Tensor | None:
        """DAPO's soft overlong punishment (``algorithm.overlong_buffer_len`` > 0), added to
        the training rollouts' scores before advantages and dynamic sampling see them."""
        algo = self.cfg.algorithm
        if not algo.overlong_buffer_len:
            return None
        lengths_B = torch.tensor([len(r) for r in samples["response_ids"]])
        penalty_B = overlong_soft_penalty(
            lengths_B,
            self.cfg.response_length,
            algo.overlong_buffer_len,
            algo.overlong_penalty_factor,
        )
        samples.tensors["scores"] = samples["scores"] + penalty_B
        return penalty_B

    def _rollout_metrics(self, samples: Batch) -> dict[str, float]:
        metrics = domain_metrics(
            "rollout", list(samples["domain"]), samples["scores"].tolist(), samples["reward_info"]
        )
        lengths = [len(r) for r in samples["response_ids"]]
        metrics["rollout/response_length"] = sum(lengths) / len(lengths)
        metrics["rollout/truncated_fraction"] = sum(
            f == "length" for f in samples["finish_reason"]
        ) / len(lengths)
        return metrics

    def _pack(self, samples: Batch) -> Batch:
        tensors = pack_sequences(
            list(samples["prompt_ids"]), list(samples["response_ids"]), self._pad_id()
        )
        width = tensors["input_ids"].shape[1]
        prompt_lengths = [len(p) for p in samples["prompt_ids"]]
        tensors["rollout_logprobs"] = scatter_response_values(
            list(samples["rollout_logprobs"]), prompt_lengths, width
        )
        # The actor's loss mask; rewards, advantages, KL-in-reward and the critic keep the
        # response mask (mask_truncated drops truncated rows from the policy loss only).
        tensors["loss_mask"] = tensors["response_mask"].clone()
        if self.cfg.algorithm.mask_truncated:
            truncated = torch.tensor([f == "length" for f in samples["finish_reason"]])
            tensors["loss_mask"][truncated] = 0.0
        tensors["scores"] = samples["scores"]
        non_tensors = {k: samples[k] for k in ("domain", "id", "response_text")}
        return Batch(tensors, non_tensors)

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def reference_logprobs(self, inputs: Batch) -> Batch:
        if "reference" in self.clusters:
            return self.clusters["reference"].compute_logprobs(inputs, key="ref_logprobs")
        # LoRA: the actor with its adapter disabled is the reference policy.
        return self.actor_train.compute_logprobs(inputs, key="ref_logprobs", disable_adapter=True)

    def compute_advantages(self, batch: Batch) -> dict[str, float]:
        """Add ``advantages`` (and the critic's ``returns``) to ``batch``; returns metrics."""
        columns, metrics = batch_advantages(
            self.cfg.algorithm, batch.tensors, self.cfg.num_return_sequences_in_group
        )
        batch.tensors.update(columns)
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
            self.actor_infer, self._score, self.tokenizer, self.eval_rows, self.cfg
        )

    def save_checkpoint(self, step: int, metrics: dict[str, float] | None = None) -> Path:
        """Save checkpoint ``step``; with ``save_best``, keep it as ``checkpoints/best`` too if
        ``metrics`` (this step's, eval included) hold the best value so far."""
        self.colocation.enter(TRAIN, self.policy_version)  # engine states back on their GPUs
        partial = self.checkpoints.begin(step)
        saves = [
            self.clusters[n].submit("save_checkpoint", str(partial / n), "engine")
            for n in self._trained_roles
        ]
        for call in saves:
            call.get()
        if self.queue is not None:  # the batches generated ahead train after a resume too
            self.queue.save(partial)
        # What `python -m roll_ds.export` needs besides the engine state (base model, LoRA).
        ExportInfo.from_config(self.cfg, self.model_dir).save(partial)
        state = {
            "step": step,
            "sampler": self.sampler.state_dict(),
            "rng": capture_rng_state(),
            "exp_name": self.cfg.exp_name,
        }
        final = self.checkpoints.commit(partial, state)
        if self.cfg.save_best:
            if getattr(self, "best", None) is None:  # a resumed run goes on from its record
                self.best = BestCheckpoint(
                    self.checkpoints.root,
                    self.cfg.save_best,
                    self.cfg.save_best_mode,
                    resume=bool(self.cfg.resume_from_checkpoint),
                )
            self.best.offer(final, step, metrics or {})
        if self.cfg.export.every_save:
            self.exported = export_run_step(self.actor_train, self.out_dir, step)
        return final

    def _maybe_resume(self) -> int:
        if not self.cfg.resume_from_checkpoint:
            return 0
        path = self.checkpoints.resolve(self.cfg.resume_from_checkpoint)
        state = self.checkpoints.load_state(path)
        for name in self._trained_roles:
            if not (path / name).is_dir():
                raise FileNotFoundError(
                    f"resume_from_checkpoint: {path} has no {name}/ state (saved by a run "
                    f"without the {name} role?)"
                )
        loads = [
            self.clusters[n].submit("load_checkpoint", str(path / n), "engine")
            for n in self._trained_roles
        ]
        for call in loads:
            call.get()
        self.sampler.load_state_dict(state["sampler"])
        if self.queue is not None:
            self.queue.load(path)
        restore_rng_state(state["rng"])
        step = int(state["step"])
        # The resumed run dumps the later steps' rollouts again (metrics: Tracker(resume_step=)).
        truncate_jsonl_after(self.out_dir / ROLLOUTS_FILE, step)
        logger.info("resumed from %s at step %d", path, step)
        self.policy_version = step
        return step


ASYNC_TIS_CAP = 2.0  # algorithm.tis_cap when it is null under async_generation
AUTO_REUSE_PARITY = 1e-4  # algorithm.old_logprobs=auto: the parity gap that proves reuse safe


def rollout_temperature(cfg: RLVRConfig) -> float:
    """The temperature rollouts are sampled at, which every log-prob the trainer and the
    reference compute uses too (PPO's ratio and the KL are then of the sampling policy);
    1.0 for greedy rollouts."""
    temperature = cfg.actor_infer.generating_args.temperature
    return float(temperature) if temperature > 0 else 1.0


def _step_seed(seed: int, step: int, round_: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + round_ * 101) % (2**31 - 1)


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*dicts) if dicts else set()
    return {k: sum(d[k] for d in dicts if k in d) / sum(k in d for d in dicts) for k in keys}


def _postfix(metrics: dict[str, float]) -> dict[str, str]:
    keys = ("rollout/score", "eval/accuracy", "actor/pg_loss", "time/step")
    return {k.split("/")[-1]: f"{metrics[k]:.3g}" for k in keys if k in metrics}
