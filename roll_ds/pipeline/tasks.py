"""What a run plays: dataset rows and environment episodes, both as episode specs.

Every task is an environment: a dataset row is one of a single turn (its prompt the observation,
its response scored by the reward roles), a ``custom_envs`` environment one of as many turns as
it plays. A step plays ``rollout_batch_size`` groups of ``num_return_sequences_in_group``
episodes (a GRPO group shares its prompt or its environment seed):

    row groups   rollout_batch_size - train_env_manager.num_env_groups prompts, drawn by the
                 sampler across the data's domains (actor_train.data_args)
    env groups   train_env_manager.num_env_groups, spread over its tags, seeds from (seed, step)

so a run may be all rows (RLVR), all environments (agentic) or both in one batch. Held-out
tasks are the validation rows and the ``val_env_manager`` episodes. Everything here is read and
checked before any actor starts: malformed rows, prompts over ``prompt_length``, environments
that fail to build or whose first observation is too long.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_ds.agentic.env_pool import EnvTypeSpec, LocalEnvPool
from roll_ds.agentic.runner import EpisodeSpec
from roll_ds.config.agentic import EnvManagerConfig
from roll_ds.config.schema import RLVRConfig
from roll_ds.data.sampler import PromptSampler
from roll_ds.pipeline.prompt_rows import encode_prompts, load_prompt_rows
from roll_ds.pipeline.rollout import domain_routes
from roll_ds.pipeline.seeds import step_seed

EVAL_FIRST_ID = 1 << 40  # held-out episode ids while training episodes are in flight
PROBE_GROUPS = 4  # environment groups whose first observation can serve as the parity probe


def group_tags(manager: EnvManagerConfig) -> list[str]:
    """The environment tag of each of the manager's groups, in order."""
    partition = manager.num_groups_partition
    if partition is None:  # split evenly, the first tags taking the remainder
        base, extra = divmod(manager.num_env_groups, len(manager.tags))
        partition = [base + (i < extra) for i in range(len(manager.tags))]
    return [tag for tag, n in zip(manager.tags, partition, strict=True) for _ in range(n)]


def env_specs(
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


def row_specs(
    rows: Sequence[dict], row_ids: Sequence[int], group_size: int, *, first_group: int = 0
) -> list[EpisodeSpec]:
    """``group_size`` episodes for each row (``row_ids[i]`` its index in ``rows``); group
    ``first_group + i``, seeded at position ``i`` of the draw."""
    specs = []
    for i, row_id in enumerate(row_ids):
        row = rows[row_id]
        for _ in range(group_size):
            specs.append(
                EpisodeSpec(
                    -1 - len(specs),  # never an environment's id
                    first_group + i,
                    row["domain"],
                    prompt_ids=row["prompt_ids"],
                    row=row_id,
                    index=i,
                )
            )
    return specs


@dataclass
class Tasks:
    """The run's rows, environments and the sampler that draws the rows of each step."""

    cfg: RLVRConfig
    tokenizer: Any
    train_rows: list[dict] = field(default_factory=list)
    eval_rows: list[dict] = field(default_factory=list)
    routes: dict[str, str] = field(default_factory=dict)  # data domain -> reward role
    sampler: PromptSampler | None = None
    probe_prompts: list[list[int]] = field(default_factory=list)  # the parity probe's
    _row_index: dict[int, int] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, cfg: RLVRConfig, tokenizer: Any) -> Tasks:
        """Read and check the rows and environments of ``cfg`` (no actor runs yet)."""
        tasks = cls(cfg, tokenizer)
        if cfg.actor_train.data_args.file_name:
            tasks._load_rows()
        if cfg.train_env_manager.tags:
            first = tasks._first_observations()
            if not tasks.probe_prompts:
                tasks.probe_prompts = first
        return tasks

    @property
    def env_groups(self) -> int:
        return self.cfg.train_env_manager.num_env_groups if self.cfg.train_env_manager.tags else 0

    @property
    def row_groups(self) -> int:
        return self.cfg.rollout_batch_size - self.env_groups

    def env_types(self) -> dict[str, EnvTypeSpec]:
        return {
            tag: EnvTypeSpec(spec.env_type, dict(spec.env_config))
            for tag, spec in self.cfg.custom_envs.items()
        }

    # --- a training step -----------------------------------------------------------------

    def draw_rows(self, count: int) -> list[int]:
        """The next ``count`` prompts of the sampler (indices into ``train_rows``)."""
        if not count:
            return []
        return [self._row_index[id(row)] for row in self.sampler.next_batch(count)]

    def step_specs(self, step: int, row_ids: Sequence[int], *, ahead: bool) -> list[EpisodeSpec]:
        """Step ``step``'s episodes: the groups of ``row_ids``, then the environment groups.
        ``ahead`` (async): environment ids start at ``step x episodes per step``, so the steps
        in flight never share one on the environment workers."""
        cfg = self.cfg
        specs = row_specs(self.train_rows, row_ids, cfg.num_return_sequences_in_group)
        if self.env_groups:
            manager = cfg.train_env_manager
            seeds = train_seeds(cfg.seed, step, self.env_groups, cfg.agentic.val_seed_offset)
            first_id = step * self.env_groups * manager.group_size if ahead else 0
            for spec in env_specs(manager, seed_of_group=seeds, first_id=first_id):
                spec.group += len(row_ids)
                specs.append(spec)
        return specs

    # --- held-out ----------------------------------------------------------------------------

    def eval_row_specs(self, samples: int) -> list[EpisodeSpec]:
        """``samples`` episodes of every held-out row."""
        return row_specs(self.eval_rows, range(len(self.eval_rows)), samples)

    def eval_env_specs(self, *, ahead: bool) -> list[EpisodeSpec]:
        """One group per ``val_env_manager`` group, seeds from ``agentic.val_seed_offset``."""
        cfg, manager = self.cfg, self.cfg.val_env_manager
        if not manager.tags:
            return []
        seeds = [cfg.agentic.val_seed_offset + g for g in range(manager.num_env_groups)]
        return env_specs(manager, seed_of_group=seeds, first_id=EVAL_FIRST_ID if ahead else 0)

    # --- loading -----------------------------------------------------------------------------

    def _load_rows(self) -> None:
        cfg = self.cfg
        train_args, eval_args = cfg.actor_train.data_args, cfg.validation.data_args
        train_rows = load_prompt_rows(train_args)
        eval_rows = load_prompt_rows(eval_args)
        if cfg.validation.max_prompts:
            eval_rows = eval_rows[: cfg.validation.max_prompts]
        limit = cfg.prompt_length
        tok = self.tokenizer
        self.train_rows = encode_prompts(tok, train_rows, train_args, "actor_train", limit)
        self.eval_rows = encode_prompts(tok, eval_rows, eval_args, "validation", limit)
        domains = {r["domain"] for r in self.train_rows + self.eval_rows}
        self.routes = domain_routes(
            sorted(domains), {name: r.tag_included for name, r in cfg.rewards.items()}
        )
        self.sampler = PromptSampler(
            self.train_rows, seed=cfg.seed, domain_probs=dict(train_args.domain_interleave_probs)
        )
        self._row_index = {id(row): i for i, row in enumerate(self.train_rows)}
        self.probe_prompts = [r["prompt_ids"] for r in self.train_rows if len(r["prompt_ids"]) >= 2]

    def _first_observations(self) -> list[list[int]]:
        """The first observations of a few training groups, rendered: an environment that fails
        to build, or whose first observation exceeds ``prompt_length``, fails here."""
        from roll_ds.agentic.chat import ChatFormat

        cfg, manager = self.cfg, self.cfg.train_env_manager
        groups = min(PROBE_GROUPS, manager.num_env_groups)
        seeds = train_seeds(cfg.seed, 0, manager.num_env_groups, cfg.agentic.val_seed_offset)
        specs = env_specs(manager, seed_of_group=seeds)[:: manager.group_size][:groups]
        pool = LocalEnvPool(self.env_types(), cfg.agentic.step_timeout_s)
        replies = pool.reset([(s.episode_id, s.tag, s.env_seed) for s in specs])
        pool.shutdown()
        prompts = []
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
            prompts.append(ids)
        return prompts
