"""The rollout phase of an agentic step: environment episodes -> a packed training batch.

``EpisodePhase`` has the shape of ``RolloutPhase`` (``step_batch``), so the step in
``rlvr.py`` reads the same: it draws the step's environment groups (``train_env_manager``:
``num_env_groups`` groups of ``group_size`` episodes sharing an environment seed, spread over
``tags``), plays them with ``roll_ds.agentic.runner.EpisodeRunner`` on the rollout engines
(one generate call per turn for every unfinished episode) and packs them: the sequence is the
first observation, then every policy and observation token; ``response_mask`` (and so the loss,
KL, entropy, advantages and log-prob metrics) covers the policy's tokens only.

``evaluate`` plays the held-out groups (``val_env_manager``, seeds from
``agentic.val_seed_offset``) with ``validation.generating_args`` (greedy by default).

Under ``async_generation`` the episodes of the next ``max_staleness`` steps are played in
driver threads while the trainer trains (``episode_queue.py``).
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from roll_ds.agentic.episode import Episode
from roll_ds.agentic.runner import EpisodeRunner, EpisodeSpec, TurnLimits, episode_metrics
from roll_ds.algorithms.turns import discounted_turn_returns
from roll_ds.config.agentic import EnvManagerConfig
from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.batch import Batch
from roll_ds.pipeline.colocation import GENERATE, Choreography
from roll_ds.pipeline.episode_queue import EpisodeQueue, EpisodesInFlight
from roll_ds.pipeline.seeds import step_seed
from roll_ds.pipeline.sequences import pack_sequences, scatter_response_values
from roll_ds.pipeline.sync_gate import SyncGate

EVAL_FIRST_ID = 1 << 40  # held-out episode ids while training episodes are in flight


def group_tags(manager: EnvManagerConfig) -> list[str]:
    """The environment tag of each of the manager's groups, in order."""
    partition = manager.num_groups_partition
    if partition is None:  # split evenly, the first tags taking the remainder
        base, extra = divmod(manager.num_env_groups, len(manager.tags))
        partition = [base + (i < extra) for i in range(len(manager.tags))]
    return [tag for tag, n in zip(manager.tags, partition, strict=True) for _ in range(n)]


def episode_specs(
    manager: EnvManagerConfig, *, seed_of_group: Sequence[int], first_id: int = 0
) -> list[EpisodeSpec]:
    """``group_size`` episodes per group, contiguous (the GRPO layout), sharing its seed."""
    specs = []
    for group, (tag, env_seed) in enumerate(zip(group_tags(manager), seed_of_group, strict=True)):
        for _ in range(manager.group_size):
            specs.append(EpisodeSpec(first_id + len(specs), group, tag, env_seed))
    return specs


def train_seeds(seed: int, step: int, num_groups: int, val_offset: int) -> list[int]:
    """Environment seeds of step ``step``'s groups: a function of ``(seed, step)`` (exact
    resume needs no state), below ``val_offset`` (never a held-out episode)."""
    rng = random.Random(step_seed(seed, step, 0))
    return [rng.randrange(val_offset) for _ in range(num_groups)]


def pack_episodes(episodes: Sequence[Episode], pad_id: int, *, gamma: float) -> Batch:
    """The training batch: tokens, ``response_mask`` = the policy mask, rollout log-probs,
    ``scores`` (each episode's return), ``turn_returns`` (each policy token's discounted return
    from its turn) and the readable columns ``domain`` (the tag), ``id``, ``response_text``,
    ``status``, ``turns``."""
    tensors = pack_sequences(
        [e.prompt_ids for e in episodes], [e.token_ids for e in episodes], pad_id
    )
    width = tensors["input_ids"].shape[1]
    prompt_lengths = [len(e.prompt_ids) for e in episodes]
    policy_BT = scatter_response_values([e.policy_mask for e in episodes], prompt_lengths, width)
    tensors["response_mask"] = policy_BT
    tensors["loss_mask"] = policy_BT.clone()
    tensors["rollout_logprobs"] = scatter_response_values(
        [e.logprobs for e in episodes], prompt_lengths, width
    )
    token_returns = []
    for e in episodes:
        returns = discounted_turn_returns(e.turn_rewards, gamma)
        token_returns.append([returns[t] if returns else 0.0 for t in e.turn_index])
    tensors["turn_returns"] = scatter_response_values(token_returns, prompt_lengths, width)
    tensors["scores"] = torch.tensor([e.total_reward for e in episodes], dtype=torch.float32)
    non_tensors = {
        "domain": [e.tag for e in episodes],
        "id": [f"{e.tag}-{e.env_seed}-{e.episode_id}" for e in episodes],
        "response_text": [" | ".join(t["action"] for t in e.turns) for e in episodes],
        "status": [e.status for e in episodes],
        "turns": [e.turns for e in episodes],
    }
    return Batch(tensors, non_tensors)


@dataclass
class EpisodePhase:
    """Plays and packs the agentic steps' episodes on the rollout engines (``actor_infer``)."""

    cfg: RLVRConfig
    clusters: Mapping[str, Any]
    colocation: Choreography
    tokenizer: Any
    pool: Any  # roll_ds.agentic.env_pool.RayEnvPool
    pad_id: int
    queue: EpisodeQueue | None = None  # async_generation: the steps played ahead
    # The sync phase's gate: a turn waits while a weight sync has the engines (sync_gate.py).
    gate: SyncGate = field(default_factory=SyncGate)
    _runner: EpisodeRunner = field(init=False, repr=False)
    _eval_runner: EpisodeRunner = field(init=False, repr=False)

    def __post_init__(self) -> None:
        gen = self.cfg.validation.generating_args
        greedy = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
        self._runner = self._episode_runner({})  # the rollout's generating_args
        self._eval_runner = self._episode_runner(greedy)
        self._threads = (
            ThreadPoolExecutor(self.queue.depth + 1, thread_name_prefix="roll_ds-episodes")
            if self.queue is not None
            else None
        )

    def _episode_runner(self, sampling: dict[str, Any]) -> EpisodeRunner:
        cfg = self.cfg
        limits = {tag: TurnLimits.of(spec) for tag, spec in cfg.custom_envs.items()}
        return EpisodeRunner(
            tokenizer=self.tokenizer,
            pool=self.pool,
            generate=functools.partial(self._generate, sampling=sampling),
            limits=limits,
            max_context_tokens=cfg.prompt_length + cfg.response_length,
            error_reward=cfg.agentic.error_reward,
        )

    def step_batch(
        self, step: int, *, policy_version: int, rollout_version: int | None
    ) -> tuple[Batch, dict[str, float]]:
        cfg = self.cfg
        started = time.perf_counter()
        if self.queue is None:
            self.colocation.enter(GENERATE, policy_version)
            episodes, timings = self._play(step)
            staleness = 0.0
        else:  # played ahead (episode_queue.py); the step waits for what is not done yet
            self.queue.fill(step, lambda s: self._submit(s, rollout_version), stop=cfg.max_steps)
            item = self.queue.take(step)
            episodes, timings = item.output["episodes"], item.output["timings"]
            staleness = item.staleness(step)[0]
        waited = time.perf_counter() - started
        batch = pack_episodes(episodes, self.pad_id, gamma=cfg.agentic.turn_gamma)
        stats = episode_metrics(episodes, "rollout")
        stats["rollout/score"] = float(batch["scores"].mean())
        stats["rollout/staleness"] = staleness
        stats["time/rollout_generate"] = (
            timings["generate_s"] if self.queue is None else waited
        )  # async: the part of playing the step waited for
        stats["time/rollout_env"] = timings["env_s"]
        stats["time/rollout_episodes"] = waited
        return batch, stats

    def _play(self, step: int) -> tuple[list[Episode], dict]:
        """Step ``step``'s episodes, played to the end. Played ahead (async), their ids start
        at ``step x episodes per step``: the environments of steps in flight never share one."""
        cfg, manager = self.cfg, self.cfg.train_env_manager
        seeds = train_seeds(cfg.seed, step, manager.num_env_groups, cfg.agentic.val_seed_offset)
        first_id = 0 if self.queue is None else step * manager.num_env_groups * manager.group_size
        specs = episode_specs(manager, seed_of_group=seeds, first_id=first_id)
        return self._runner.run(specs, seed=step_seed(cfg.seed, step, 1))

    def _submit(self, step: int, rollout_version: int | None) -> EpisodesInFlight:
        assert rollout_version is not None, "the engines must be synced before generating"
        future = self._threads.submit(self._play, step)
        return EpisodesInFlight(step=step, version=rollout_version, future=future)

    def evaluate(self) -> dict[str, float]:
        """``eval/success`` (and per tag, turns, tool calls, ...) on the held-out seeds. With
        training episodes in flight (async) the held-out ones take ids above theirs."""
        cfg, manager = self.cfg, self.cfg.val_env_manager
        seeds = [cfg.agentic.val_seed_offset + g for g in range(manager.num_env_groups)]
        first_id = 0 if self.queue is None else EVAL_FIRST_ID
        specs = episode_specs(manager, seed_of_group=seeds, first_id=first_id)
        episodes, _ = self._eval_runner.run(specs, seed=cfg.seed)
        return episode_metrics(episodes, "eval")

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    def _generate(
        self,
        contexts: list[list[int]],
        max_new_tokens: list[int],
        rows: list[int],
        seed: int,
        *,
        sampling: dict[str, Any],
    ) -> dict[str, list[Any]]:
        """One turn of every context on the rollout workers; results in ``contexts`` order."""
        batch = Batch(
            non_tensors={"prompt_ids": contexts, "row": rows, "max_new_tokens": max_new_tokens}
        )
        with self.gate.call():
            out = (
                self.clusters["actor_infer"]
                .submit("generate_turns", batch, seed=seed, **sampling)
                .get()
            )
        order = {int(r): i for i, r in enumerate(out["row"])}
        pick = [order[int(r)] for r in rows]
        return {
            "response_ids": [out["response_ids"][i] for i in pick],
            "rollout_logprobs": [out["rollout_logprobs"][i] for i in pick],
            "finish_reason": [out["finish_reason"][i] for i in pick],
        }
