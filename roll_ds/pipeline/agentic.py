"""The agentic pipeline: the RLVR loop with environment episodes as its rollout phase.

Everything but the rollout is the RLVR step (``rlvr.py``): weight sync, log-probs, advantages,
training, checkpoints and exact resume are the same code. What differs:

- the rollout phase is ``EpisodePhase`` (``episode_phase.py``): episodes over environment
  workers (``agentic.num_env_workers`` Ray actors) instead of prompts from data files;
- ``reward_mode: per_turn`` replaces GRPO's broadcast return by each turn's discounted return
  (``roll_ds/algorithms/turns.py``);
- evaluation plays the held-out environment seeds (``eval/success``);
- the environment seeds of a step are a function of ``(seed, step)``, so nothing about them is
  checkpointed; the weight-sync parity probe uses the first observations of training episodes;
- under ``async_generation`` the queue of steps played ahead is an ``EpisodeQueue``.
"""

from __future__ import annotations

from typing import Any

from roll_ds.agentic.env_pool import EnvTypeSpec, LocalEnvPool, RayEnvPool
from roll_ds.algorithms.turns import per_turn_advantages
from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.batch import Batch
from roll_ds.models.shipped import resolve_pretrain
from roll_ds.pipeline.episode_phase import EpisodePhase, episode_specs, train_seeds
from roll_ds.pipeline.episode_queue import EpisodeQueue
from roll_ds.pipeline.rlvr import RLVRPipeline
from roll_ds.pipeline.sequences import pad_token_id

PROBE_GROUPS = 4  # training episodes whose first observation is the parity probe


class EnvSeedState:
    """Stands where the RLVR pipeline keeps its prompt sampler: environment seeds are drawn
    from ``(seed, step)``, so a checkpoint needs nothing but the step."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class AgenticPipeline(RLVRPipeline):
    def __init__(self, cfg: RLVRConfig) -> None:
        super().__init__(cfg)
        self.env_pool: Any = None
        if self.queue is not None:  # async_generation: episodes played ahead
            self.queue = EpisodeQueue(self.queue.depth)

    def _env_specs(self) -> dict[str, EnvTypeSpec]:
        return {
            tag: EnvTypeSpec(spec.env_type, dict(spec.env_config))
            for tag, spec in self.cfg.custom_envs.items()
        }

    def _load_data(self) -> None:
        """The tokenizer, and the parity probe's rows: the first observations of a few training
        episodes (an environment that fails to build fails here, before any actor starts)."""
        from transformers import AutoTokenizer

        from roll_ds.agentic.chat import ChatFormat

        cfg = self.cfg
        self.model_dir = resolve_pretrain(cfg.pretrain)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        manager = cfg.train_env_manager
        groups = min(PROBE_GROUPS, manager.num_env_groups)
        seeds = train_seeds(cfg.seed, 0, manager.num_env_groups, cfg.agentic.val_seed_offset)
        specs = episode_specs(manager, seed_of_group=seeds)[:: manager.group_size][:groups]
        pool = LocalEnvPool(self._env_specs(), cfg.agentic.step_timeout_s)
        replies = pool.reset([(s.episode_id, s.tag, s.env_seed) for s in specs])
        pool.shutdown()
        self.train_rows = []
        for spec, reply in zip(specs, replies, strict=True):
            if reply.status != "ok":
                raise ValueError(
                    f"custom_envs.{spec.tag}: reset(seed={spec.env_seed}) failed: "
                    f"{reply.error.strip().splitlines()[-1]}"
                )
            ids = ChatFormat(self.tokenizer, reply.tools).prompt_ids(reply.observation)
            if len(ids) > cfg.prompt_length:
                raise ValueError(
                    f"prompt_length: {cfg.prompt_length} but the first observation of "
                    f"custom_envs.{spec.tag} is {len(ids)} tokens; raise prompt_length"
                )
            self.train_rows.append({"prompt_ids": ids})
        self.eval_rows = []
        self.routes = {}
        self.sampler = EnvSeedState()

    def start(self, *, eval_only: bool = False) -> None:
        super().start(eval_only=eval_only)
        cfg = self.cfg
        self.env_pool = RayEnvPool(
            self._env_specs(), cfg.agentic.step_timeout_s, cfg.agentic.num_env_workers
        )
        self.rollouts = EpisodePhase(
            cfg=cfg,
            clusters=self.clusters,
            colocation=self.colocation,
            tokenizer=self.tokenizer,
            pool=self.env_pool,
            pad_id=pad_token_id(self.tokenizer),
            queue=self.queue,
            gate=self.policy_sync.gate,
        )

    def shutdown(self) -> None:
        if isinstance(self.rollouts, EpisodePhase):
            self.rollouts.close()
        if self.env_pool is not None:
            self.env_pool.shutdown()
            self.env_pool = None
        super().shutdown()

    def compute_advantages(self, batch: Batch) -> dict[str, float]:
        metrics = super().compute_advantages(batch)
        if self.cfg.agentic.reward_mode == "per_turn":
            batch.tensors["advantages"] = per_turn_advantages(
                batch["turn_returns"],
                batch["scores"],
                batch["response_mask"],
                self.cfg.num_return_sequences_in_group,
            )
        return metrics

    def evaluate(self) -> dict[str, float]:
        from roll_ds.pipeline.colocation import GENERATE

        self._unreported_sync.update(self.sync_weights())
        self.colocation.enter(GENERATE, self.policy_version)
        return self.rollouts.evaluate()
