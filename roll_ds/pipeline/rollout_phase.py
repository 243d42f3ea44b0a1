"""The rollout phase of a step: tasks -> episodes -> scores -> a packed training batch.

``RolloutPhase`` plays a step's tasks (``tasks.py``: dataset rows and environment episodes) with
``roll_ds.agentic.runner.EpisodeRunner`` on the rollout engines (``engines.py``), has the reward
roles score the rows (``scoring.py``; environments rewarded their episodes as they played),
applies DAPO's overlong penalty, with ``algorithm.dynamic_sampling`` draws more row groups until
enough carry a signal, and packs the episodes (``packing.py``). Under ``async_generation`` the
steps ahead play in driver threads (``rollout_queue.py``); the step waits for its own.
``evaluate`` plays the held-out tasks through the same runner (``evaluation.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from roll_ds.agentic.env_pool import ROLE as ENV_ROLE
from roll_ds.agentic.episode import Episode
from roll_ds.agentic.runner import EpisodeRunner, Sample, TurnLimits, TurnRequest
from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.batch import Batch
from roll_ds.pipeline.colocation.choreography import GENERATE, Choreography
from roll_ds.pipeline.engines import RolloutEngines
from roll_ds.pipeline.packing import pack_episodes, rollout_metrics
from roll_ds.pipeline.rollout_queue import InFlight, RolloutQueue
from roll_ds.pipeline.scoring import (
    apply_overlong_penalty,
    fit_groups,
    group_has_signal,
    score_rows,
)
from roll_ds.pipeline.seeds import step_seed
from roll_ds.pipeline.sequences import pad_token_id
from roll_ds.pipeline.tasks import Tasks


@dataclass
class RolloutPhase:
    """Plays, scores and packs the steps' episodes. ``clusters`` holds the ``rewards.<role>``
    clusters; ``pool`` the environment workers (None without environments); ``parity`` the
    sync phase's parity check, whose probe may ride on a step's first generate call."""

    cfg: RLVRConfig
    engines: RolloutEngines
    clusters: Mapping[str, Any]
    colocation: Choreography
    tasks: Tasks
    tokenizer: Any
    pool: Any = None
    queue: RolloutQueue | None = None
    parity: Any = None
    _threads: ThreadPoolExecutor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.stream = cfg.async_generation.mode == "stream" and self.queue is not None
        self.limits = {tag: TurnLimits.of(spec) for tag, spec in cfg.custom_envs.items()}
        if self.queue is not None:
            self._threads = ThreadPoolExecutor(self.queue.depth + 1, "roll_ds-rollouts")

    def runner(self, sampling: Mapping[str, Any], *, max_new_tokens: int, stream: bool = False):
        """An ``EpisodeRunner`` on the engines with ``sampling`` (temperature, top_p, top_k);
        rows answer in at most ``max_new_tokens``."""
        cfg = self.cfg

        def generate(requests: list[TurnRequest]) -> list[list[Sample]]:
            probe = self.parity.rollout_probe() if self.parity is not None else None
            samples, probe_logprobs = self.engines.generate(
                requests, sampling, stream=stream, probe=probe
            )
            if probe is not None:
                self.parity.finish_on_rollout(probe_logprobs)
            return samples

        return EpisodeRunner(
            tokenizer=self.tokenizer,
            pool=self.pool,
            generate=generate,
            limits=self.limits,
            max_context_tokens=cfg.prompt_length + cfg.response_length,
            error_reward=cfg.agentic.error_reward,
            row_max_new_tokens=max_new_tokens,
        )

    # --- a training step ---------------------------------------------------------------------

    def step_batch(
        self, step: int, *, policy_version: int, rollout_version: int | None
    ) -> tuple[Batch, dict[str, float]]:
        """This step's scored, packed batch: played now, or (async) taken from the queue after
        submitting the steps ``max_staleness`` ahead. Adds ``rollout/staleness``."""
        cfg = self.cfg
        self.colocation.enter(GENERATE, policy_version)  # engines loaded, trainers offloaded
        started = time.perf_counter()
        if self.queue is None:
            episodes, timings = self._play(step, self.tasks.draw_rows(self.tasks.row_groups))
            staleness = (0.0, 0.0)
        else:
            self.queue.fill(step, lambda s: self._submit(s, rollout_version), stop=cfg.max_steps)
            item = self.queue.take(step)
            episodes, timings = item.output["episodes"], item.output["timings"]
            staleness = item.staleness(step)
        waited = time.perf_counter() - started
        stats: dict[str, float] = {}
        batch = self._scored_batch(step, episodes, stats)
        stats["time/rollout_generate"] = timings["generate_s"] if self.queue is None else waited
        stats["time/rollout_env"] = timings["env_s"]
        if timings.get("redone"):  # episodes played again after their environment host died
            stats[f"faults/{ENV_ROLE}/redone_episodes"] = float(timings["redone"])
        # async: per second waited for the step's rollouts, the rest overlapped training
        stats["perf/generate_tokens_per_s"] = stats.pop("rollout/generated_tokens") / max(
            stats["time/rollout_generate"], 1e-9
        )
        stats["rollout/staleness"] = staleness[0]
        if self.tasks.row_groups and self.queue is not None:
            stats["rollout/staleness_mean"] = staleness[1]
        return batch, stats

    def _play(self, step: int, row_ids: list[int], round_: int = 0) -> tuple[list[Episode], dict]:
        """Step ``step``'s episodes (the groups of ``row_ids``, then its environment groups in
        round 0), played to the end."""
        cfg = self.cfg
        gen = cfg.actor_infer.generating_args
        specs = self.tasks.step_specs(step, row_ids, ahead=self.queue is not None)
        if round_:
            specs = [s for s in specs if s.row >= 0]
        runner = self.runner(
            {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k},
            max_new_tokens=gen.max_new_tokens or cfg.response_length,
            stream=self.stream,
        )
        return runner.run(
            specs,
            seed=step_seed(cfg.seed, step, 1),
            row_seed=step_seed(cfg.seed, step, round_),
        )

    def _submit(self, step: int, rollout_version: int | None) -> InFlight:
        """Draw step ``step``'s rows here (the sampler's order is the synchronous loop's) and
        play its episodes in a thread with the weights the engines have now
        (``rollout_version``)."""
        assert rollout_version is not None, "the engines must be synced before generating"
        row_ids = self.tasks.draw_rows(self.tasks.row_groups)
        future = self._threads.submit(self._play, step, row_ids)
        return InFlight(step=step, version=rollout_version, future=future)

    def _scored_batch(self, step: int, episodes: list[Episode], stats: dict[str, float]) -> Batch:
        """Score the rows, penalise overlong ones, resample row groups without signal
        (dynamic sampling), pack; ``stats`` gets the ``rollout/*`` metrics of the first
        round."""
        cfg, algo = self.cfg, self.cfg.algorithm
        group = cfg.num_return_sequences_in_group
        started = time.perf_counter()
        penalty = self._score(episodes)
        stats["time/rollout_reward"] = time.perf_counter() - started
        stats["rollout/generated_tokens"] = _generated_tokens(episodes)  # step_batch's rate
        stats.update(rollout_metrics(episodes, penalty))
        if not algo.dynamic_sampling:
            return self._pack(episodes, padding=0)
        kept: list[list[Episode]] = []
        spare: list[list[Episode]] = []
        drawn, round_ = 0, 0
        while True:
            groups = [episodes[g * group : (g + 1) * group] for g in range(len(episodes) // group)]
            signal = group_has_signal(_scores(episodes), group).tolist()
            kept += [g for g, s in zip(groups, signal, strict=True) if s]
            spare += [g for g, s in zip(groups, signal, strict=True) if not s]
            drawn += len(groups)
            round_ += 1
            if len(kept) >= cfg.rollout_batch_size or round_ >= algo.max_resample_rounds:
                break
            started = time.perf_counter()
            episodes, _ = self._play(step, self.tasks.draw_rows(self.tasks.row_groups), round_)
            stats["time/rollout_generate"] = stats.get("time/rollout_generate", 0.0) + (
                time.perf_counter() - started
            )
            stats["rollout/generated_tokens"] += _generated_tokens(episodes)
            self._score(episodes)
        flat, padding = fit_groups(kept, spare, cfg.rollout_batch_size)
        stats["rollout/kept_group_fraction"] = len(kept) / max(drawn, 1)
        stats["rollout/padding_groups"] = float(padding)
        return self._pack(flat, padding=padding * group)

    def _pack(self, episodes: list[Episode], *, padding: int) -> Batch:
        cfg = self.cfg
        return pack_episodes(
            episodes,
            self.tasks.train_rows,
            pad_token_id(self.tokenizer),
            gamma=cfg.agentic.turn_gamma,
            mask_truncated=cfg.algorithm.mask_truncated,
            padding=padding,
        )

    def _score(self, episodes: list[Episode]) -> Any:
        """The reward roles' scores of the row episodes, with the overlong penalty; returns the
        penalty (None: off or no rows)."""
        rows = [e for e in episodes if e.is_row]
        if not rows:
            return None
        scores = score_rows(
            rows, self.tasks.train_rows, self.clusters, self.tasks.routes, self.tokenizer
        )
        return apply_overlong_penalty(rows, scores, self.cfg.algorithm, self.cfg.response_length)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)


def _scores(episodes: list[Episode]) -> Any:
    import torch

    return torch.tensor([e.total_reward for e in episodes], dtype=torch.float32)


def _generated_tokens(episodes: list[Episode]) -> int:
    """The policy tokens the engines generated for ``episodes`` (every turn's)."""
    return sum(sum(e.policy_mask) for e in episodes)
