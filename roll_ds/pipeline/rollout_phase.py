"""The rollout phase of one RLVR step: prompts -> generations -> rewards -> a packed batch.

``RolloutPhase`` draws the step's prompts, has the rollout engines (``actor_infer``) sample
``num_return_sequences_in_group`` responses per prompt, sends each domain to its reward role,
applies DAPO's overlong penalty and, with ``algorithm.dynamic_sampling``, resamples until enough
groups carry a signal. Under ``async_generation`` the step's samples come from the
``RolloutQueue`` of batches generated ahead. The pure pieces live in ``rollout.py`` and
``sequences.py``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from roll_ds.config.schema import RLVRConfig
from roll_ds.data.sampler import PromptSampler
from roll_ds.distributed.batch import Batch, object_array
from roll_ds.pipeline.colocation import GENERATE, Choreography
from roll_ds.pipeline.rollout import (
    apply_overlong_penalty,
    fit_dynamic_batch,
    group_has_signal,
    join_samples,
    rollout_metrics,
)
from roll_ds.pipeline.rollout_queue import InFlight, RolloutQueue
from roll_ds.pipeline.seeds import step_seed
from roll_ds.pipeline.sequences import pack_samples, pad_token_id
from roll_ds.pipeline.workers import PROBE_META


@dataclass(frozen=True)
class StreamedBatch:
    """A batch in the rollout engines' request streams; ``get`` waits for its samples."""

    cluster: Any
    tag: str

    def get(self, timeout_s: float | None = None) -> Batch:
        return Batch.concat(self.cluster.submit("collect_stream", self.tag).get(timeout_s))


@dataclass
class RolloutPhase:
    """Generates and scores the training batches. ``clusters`` holds ``actor_infer`` and the
    ``rewards.<role>`` clusters; ``routes`` maps each data domain to its reward role."""

    cfg: RLVRConfig
    clusters: Mapping[str, Any]
    colocation: Choreography
    sampler: PromptSampler
    tokenizer: Any
    routes: Mapping[str, str]
    train_rows: list[dict]
    queue: RolloutQueue | None = None
    # The sync phase (PolicySync): a parity probe it deferred rides on the next generate call.
    parity: Any = None
    _row_index: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._row_index = {id(row): i for i, row in enumerate(self.train_rows)}

    def step_batch(
        self, step: int, *, policy_version: int, rollout_version: int | None
    ) -> tuple[Batch, dict[str, float]]:
        """This step's scored batch: generated now, or (async) taken from the queue after
        submitting the batches ``max_staleness`` steps ahead. Adds ``rollout/staleness``."""
        if self.queue is None:
            batch, stats = self.rollout_and_score(step, policy_version)
            stats["rollout/staleness"] = 0.0
            return batch, stats
        self.queue.fill(
            step,
            lambda s: self._submit_step(s, policy_version, rollout_version),
            stop=self.cfg.max_steps,
        )
        started = time.perf_counter()
        item = self.queue.take(step)
        waited = time.perf_counter() - started
        prompts = [self.train_rows[i] for i in item.rows]
        first = join_samples(prompts, item.output, self.tokenizer)
        batch, stats = self.rollout_and_score(step, policy_version, first=first)
        stats["time/rollout_generate"] = waited  # the part of generation the step waited for
        stats["rollout/staleness"], stats["rollout/staleness_mean"] = item.staleness(step)
        return batch, stats

    def rollout_and_score(
        self, step: int, policy_version: int, first: Batch | None = None
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
            samples, drawn_now = self._scored_round(step, rounds, policy_version, first, stats)
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
        return self._packed(kept, spare, kept_groups / max(drawn, 1), stats)

    def _scored_round(
        self,
        step: int,
        round_: int,
        policy_version: int,
        first: Batch | None,
        stats: dict[str, float],
    ) -> tuple[Batch, int]:
        """One generation round's scored samples and the number of prompts it drew; adds its
        times to ``stats`` and, for round 0, the ``rollout/*`` metrics."""
        cfg = self.cfg
        started = time.perf_counter()
        if first is not None and round_ == 0:
            samples = first
            drawn = len(samples) // cfg.num_return_sequences_in_group
        else:
            prompts = self.sampler.next_batch(cfg.rollout_batch_size)
            seed = step_seed(cfg.seed, step, round_)
            samples = self.generate(prompts, seed=seed, policy_version=policy_version, stats=stats)
            drawn = len(prompts)
        generated = time.perf_counter()
        self.score(samples)
        penalty = apply_overlong_penalty(samples, cfg.algorithm, cfg.response_length)
        stats["time/rollout_generate"] += generated - started
        stats["time/rollout_reward"] += time.perf_counter() - generated
        if round_ == 0:
            stats.update(rollout_metrics(samples))
            if penalty is not None:
                stats["rollout/overlong_penalty"] = float(penalty.mean())
        return samples, drawn

    def _packed(
        self, kept: list[Batch], spare: list[Batch], kept_fraction: float, stats: dict[str, float]
    ) -> tuple[Batch, dict[str, float]]:
        """The training batch of the kept groups (dynamic sampling: exactly
        ``rollout_batch_size`` groups, padded with groups whose loss is masked)."""
        cfg, algo = self.cfg, self.cfg.algorithm
        group = cfg.num_return_sequences_in_group
        padding = 0
        if algo.dynamic_sampling:
            stats["rollout/kept_group_fraction"] = kept_fraction
            batch, padding = fit_dynamic_batch(kept, spare, group, cfg.rollout_batch_size)
            stats["rollout/padding_groups"] = padding / group
        else:
            batch = kept[0]
        pad_id = pad_token_id(self.tokenizer)
        packed = pack_samples(batch, pad_id, mask_truncated=algo.mask_truncated)
        if padding:  # padding groups carry no signal: they stay out of the loss
            packed.tensors["loss_mask"][len(packed) - padding :] = 0.0
        return packed, stats

    def generate(
        self,
        prompts: list[dict],
        *,
        seed: int,
        policy_version: int,
        stats: dict[str, float] | None = None,
    ) -> Batch:
        """``n`` samples per prompt. A parity probe the sync deferred is scored by the engines
        in the same call and checked here (its ``sync/parity_*`` metrics go to ``stats``)."""
        pending = self.parity.pending if self.parity is not None else None
        probe = None if pending is None else pending.probe
        out = self._submit_generation(prompts, seed, policy_version, probe=probe).get()
        if pending is not None:
            ranks = sorted(int(k.split("/")[1]) for k in out.meta if k.startswith(PROBE_META))
            checked = self.parity.finish_parity([out.meta[f"{PROBE_META}{r}"] for r in ranks])
            if stats is not None:
                stats.update(checked)
        return join_samples(prompts, out, self.tokenizer)

    def _submit_step(self, step: int, policy_version: int, rollout_version: int | None) -> InFlight:
        """Draw step ``step``'s prompts and start generating them with the engines' weights."""
        prompts = self.sampler.next_batch(self.cfg.rollout_batch_size)
        seed = step_seed(self.cfg.seed, step, 0)
        assert rollout_version is not None, "the engines must be synced before generating"
        return InFlight(
            step=step,
            version=rollout_version,
            rows=[self._row_index[id(p)] for p in prompts],
            seed=seed,
            call=self._submit_generation(prompts, seed, policy_version, tag=f"step-{step}"),
        )

    def _submit_generation(
        self,
        prompts: list[dict],
        seed: int,
        policy_version: int,
        tag: str | None = None,
        probe: dict | None = None,
    ) -> Any:
        """Start ``n`` samples per prompt on the rollout engines; a pending call (``.get()``
        waits for the samples). A ``tag``ged batch under ``async_generation.mode=stream``
        joins the engines' request streams instead of queueing behind the batches there.
        ``probe``: every engine also scores these parity-probe rows (``RolloutWorker.generate``)."""
        self.colocation.enter(GENERATE, policy_version)
        prompt_batch = Batch(
            non_tensors={
                "prompt_ids": [p["prompt_ids"] for p in prompts],
                "row": range(len(prompts)),
            }
        )
        infer = self.clusters["actor_infer"]
        if tag is None or self.cfg.async_generation.mode != "stream":
            return infer.submit("generate", prompt_batch, seed=seed, probe=probe)
        infer.call("submit_stream", prompt_batch, tag=tag, seed=seed)
        return StreamedBatch(infer, tag)

    def score(self, samples: Batch) -> None:
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
