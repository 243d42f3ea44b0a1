"""The Ray actor classes of the RLVR roles: each hosts one strategy (or a reward scorer).

Methods carry their dispatch mode: ``DP`` methods get this rank's share of a ``Batch`` and
return a ``Batch`` the cluster concatenates in rank order; ``ALL`` methods run on every rank.
"""

from __future__ import annotations

from typing import Any, ClassVar

from roll_ds import timeline
from roll_ds.config.schema import RewardConfig, WorkerConfig
from roll_ds.distributed.batch import Batch
from roll_ds.distributed.dispatch import Dispatch, register
from roll_ds.distributed.hang_hook import hang_if_asked
from roll_ds.distributed.worker import Worker
from roll_ds.strategy import STRATEGIES, StrategyContext
from roll_ds.weight_sync.worker import ReceiverWorkerMixin, SenderWorkerMixin

TRAIN_METRICS = "train_metrics/"  # meta key prefix of a rank's train metrics
PROBE_META = "probe_logprobs/"  # meta key prefix of a rollout rank's parity-probe log-probs
STREAM_WAIT = "stream_wait"  # the rollout workers' concurrency group for waiting on streams


def stream_wait(method):
    """Run a worker method in the ``stream_wait`` concurrency group (Ray threads it beside the
    default group, whose calls stay one at a time)."""
    import ray

    return ray.method(concurrency_group=STREAM_WAIT)(method)


class StrategyWorker(Worker):
    """A rank of a model role (actor_train, actor_infer, reference, critic)."""

    # Extra keyword arguments of the strategy's ``from_worker_config`` for this kind of role.
    STRATEGY_KWARGS: ClassVar[dict[str, Any]] = {}

    def __init__(self, role_cfg: WorkerConfig, ctx: StrategyContext) -> None:
        super().__init__()
        self.role_cfg = role_cfg
        self.ctx = ctx
        self.strategy: Any = None

    @register(Dispatch.ALL)
    def initialize(self) -> dict[str, Any]:
        with timeline.phase("initialize"):
            with timeline.phase("import strategy"):  # the backend's module and its libraries
                cls = STRATEGIES.get(self.role_cfg.strategy_args.strategy_name)
            self.strategy = cls.from_worker_config(self.role_cfg, self.ctx, **self.STRATEGY_KWARGS)
            self.strategy.initialize()
        summary = getattr(self.strategy, "summary", None)  # logged by the driver (startup.py)
        return {
            "rank": self.rank,
            **({"summary": summary()} if callable(summary) else {}),
            **started_profile(),
        }

    @register(Dispatch.ALL)
    def close(self) -> None:
        """Close the strategy (``Worker.close``: why), then the process groups."""
        strategy, self.strategy = self.strategy, None
        if strategy is not None and hasattr(strategy, "close"):
            strategy.close()
        super().close()

    @register(Dispatch.DP)
    def compute_logprobs(
        self,
        batch: Batch,
        *,
        key: str = "logprobs",
        disable_adapter: bool = False,
        temperature: float | None = None,
    ) -> Batch:
        """``batch[key]``: log-probs ``[B, T-1]`` of ``input_ids`` under this role's model, at
        ``temperature`` (None: the rollouts' sampling temperature)."""
        kwargs: dict[str, Any] = {"disable_adapter": True} if disable_adapter else {}
        if temperature is not None:
            kwargs["temperature"] = temperature
        out = self.strategy.compute_logprobs(
            batch["input_ids"], batch["attention_mask"], with_entropy=False, **kwargs
        )
        return Batch({key: out["logprobs_BT"].float().cpu()})

    @register(Dispatch.ALL)
    def offload_states(self, **kwargs: Any) -> dict[str, int] | None:
        """Free device memory for a colocated role
        (``roll_ds/pipeline/colocation/choreography.py``); ``kwargs`` are the strategy's (a
        rollout engine's: ``level``). Returns the device memory afterwards (``device_memory``)."""
        self.strategy.offload_states(**kwargs)
        return device_memory()

    @register(Dispatch.ALL)
    def reload_states(self, **kwargs: Any) -> dict[str, int] | None:
        """Undo ``offload_states``; ``kwargs`` are the strategy's (a rollout engine's:
        ``tags``). Returns the device memory afterwards (``device_memory``)."""
        self.strategy.reload_states(**kwargs)
        return device_memory()


def started_profile() -> dict[str, Any]:
    """What ``initialize`` adds to its answer for the start-up profile (``roll_ds/timeline.py``):
    the phases this process recorded since ``__init__`` and the heavy libraries it loaded."""
    return {"timeline": timeline.drain(), "libraries": timeline.loaded_libraries()}


def device_memory() -> dict[str, int] | None:
    """This process's CUDA memory in bytes: PyTorch's ``allocated`` and ``reserved`` (its
    caching allocator; a vLLM engine's own allocator and processes are not in them), and the
    GPU's ``device_used`` (``mem_get_info``: every process on it). None without CUDA."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "device_used": total - free,
    }


class TrainWorker(StrategyWorker):
    """A rank of a role that trains on the rollout batch (actor_train, critic)."""

    @register(Dispatch.DP, even=True)
    def train_step(self, batch: Batch, loss_fn: Any) -> dict[str, float]:
        hang_if_asked(self.rank)  # a test hook, inert unless its env var is set
        tensors = dict(batch.tensors)
        return self.strategy.train_step(
            tensors, loss_fn, with_entropy=getattr(loss_fn, "needs_entropy", False)
        )

    @register(Dispatch.DP, even=True)
    def train_step_with_old_logprobs(self, batch: Batch, loss_fn: Any) -> Batch:
        """``train_step`` filling the batch's ``old_logprobs`` as it trains (the strategy's
        ``train_step_with_old_logprobs``): a Batch of this rank's ``old_logprobs`` rows, its
        metrics in ``meta[f"train_metrics/{rank}"]`` (so the cluster's concat keeps each
        rank's)."""
        hang_if_asked(self.rank)  # a test hook, inert unless its env var is set
        metrics, old = self.strategy.train_step_with_old_logprobs(
            dict(batch.tensors), loss_fn, with_entropy=getattr(loss_fn, "needs_entropy", False)
        )
        return Batch({"old_logprobs": old}, meta={f"{TRAIN_METRICS}{self.rank}": metrics})

    @register(Dispatch.ALL)
    def save_checkpoint(self, path: str, tag: str) -> None:
        self.strategy.save_checkpoint(path, tag)

    @register(Dispatch.ALL)
    def load_checkpoint(self, path: str, tag: str) -> None:
        self.strategy.load_checkpoint(path, tag)


class CriticWorker(TrainWorker):
    """A rank of the critic: the strategy holds a value model (``head="value"``)."""

    STRATEGY_KWARGS: ClassVar[dict[str, Any]] = {"head": "value"}

    @register(Dispatch.DP)
    def compute_values(self, batch: Batch) -> Batch:
        """``batch["values"]``: values ``[B, T-1]`` of ``input_ids`` (log-prob layout)."""
        out = self.strategy.compute_values(batch["input_ids"], batch["attention_mask"])
        return Batch({"values": out["values_BT"].float().cpu()})


class ActorTrainWorker(SenderWorkerMixin, TrainWorker):
    """A rank of the policy trainer; its weight-sync methods (the sending side) come from
    ``SenderWorkerMixin``."""

    @register(Dispatch.ALL)
    def export_hf(self, path: str) -> dict[str, str]:
        return self.strategy.export_hf(path)


class RolloutWorker(ReceiverWorkerMixin, StrategyWorker):
    """A rank of a rollout role; its weight-sync methods (the receiving side) come from
    ``ReceiverWorkerMixin``."""

    # collect_stream waits here, beside the default group where the weight syncs run
    CONCURRENCY_GROUPS: ClassVar[dict[str, int]] = {STREAM_WAIT: 16}

    def __init__(self, role_cfg: WorkerConfig, ctx: StrategyContext) -> None:
        super().__init__(role_cfg, ctx)
        self._stream_rows: dict[str, list[int]] = {}  # streamed batch tag -> its rows

    @register(Dispatch.DP)
    def generate(
        self,
        batch: Batch,
        *,
        seed: int,
        n: int | None = None,
        probe: dict | None = None,
        **sampling: Any,
    ) -> Batch:
        """``n`` samples per context (``prompt_ids``, at most ``max_new_tokens`` new tokens
        each where the column is given); rows come back grouped by context, ``row`` saying
        whose. Each context's request is seeded by its ``row`` (a dataset row's position in the
        draw, an episode's id), so what it samples does not depend on the split over workers.
        ``probe`` (``input_ids`` / ``attention_mask``, the whole probe on every rank): its
        log-probs for the weight-sync parity check, scored in the same engine steps, come back
        as meta ``probe_logprobs/<rank>``."""
        rows = [int(r) for r in batch["row"]]
        extra: dict[str, Any] = {} if probe is None else {"probe": probe}
        if "max_new_tokens" in batch.non_tensors:
            extra["max_new_tokens_each"] = [int(m) for m in batch["max_new_tokens"]]
        out = self.strategy.generate(
            list(batch["prompt_ids"]), n=n, seed=seed, prompt_indices=rows, **extra, **sampling
        )
        meta = {}
        if probe is not None:
            meta[f"{PROBE_META}{self.rank}"] = out["probe_logprobs_BT"].float().cpu()
        return Batch(
            non_tensors={
                "row": [rows[i] for i in out["prompt_index"]],
                "response_ids": out["response_ids"],
                "rollout_logprobs": out["logprobs"],
                "finish_reason": out["finish_reason"],
            },
            meta=meta,
        )

    # --- streaming generation (async_generation.mode: stream) ---------------------------------

    @register(Dispatch.DP)
    def submit_stream(
        self, batch: Batch, *, tag: str, seed: int, n: int | None = None, **sampling: Any
    ) -> None:
        """Start generating this rank's share of ``batch`` as ``generate`` would, without
        waiting: the requests join the engine's stream (``collect_stream(tag)`` takes them)."""
        rows = [int(r) for r in batch["row"]]
        self._stream_rows[tag] = rows
        extra: dict[str, Any] = {}
        if "max_new_tokens" in batch.non_tensors:
            extra["max_new_tokens_each"] = [int(m) for m in batch["max_new_tokens"]]
        self.strategy.submit(
            tag, list(batch["prompt_ids"]), n=n, seed=seed, prompt_indices=rows, **extra, **sampling
        )

    @register(Dispatch.ALL)
    @stream_wait
    def collect_stream(self, tag: str, timeout_s: float | None = None) -> Batch:
        """This rank's share of batch ``tag`` (``generate``'s columns plus
        ``token_versions``), once finished; the ranks' shares concatenate in prompt order. Runs
        in the ``stream_wait`` concurrency group: a weight sync's pause, reload and resume
        (the default group) go on while it waits, and it waits through them."""
        out = self.strategy.collect(tag, timeout_s)
        rows = self._stream_rows.pop(tag)
        return Batch(
            non_tensors={
                "row": [rows[i] for i in out["prompt_index"]],
                "response_ids": out["response_ids"],
                "rollout_logprobs": out["logprobs"],
                "finish_reason": out["finish_reason"],
                "token_versions": out["token_versions"],
            }
        )

    @register(Dispatch.ALL)
    def pause_generation(self) -> None:
        """Before a sync: stop the stream between two decode steps."""
        self.strategy.pause_generation()

    @register(Dispatch.ALL)
    def resume_generation(self, version: int) -> None:
        """After a sync: generate on, labelling new tokens with policy ``version``."""
        self.strategy.resume_generation(version)

    @register(Dispatch.ALL)
    def probe_logprobs(self, batch: Batch) -> Any:
        """Log-probs ``[B, T-1]`` of the *whole* probe on this rank (weight-sync parity), at
        temperature 1 as the trainer's side (``weight_sync.parity``): hf_infer would otherwise
        score at the rollouts' sampling temperature."""
        out = self.strategy.compute_logprobs(
            batch["input_ids"], batch["attention_mask"], with_entropy=False, temperature=1.0
        )
        return out["logprobs_BT"].float().cpu()


class RewardWorker(Worker):
    """A rank of a reward role: scores responses of its domains with rule-based reward fns and,
    when the role names a model, its reward model or judge (``rewards/model_reward.py``)."""

    def __init__(self, reward_cfg: RewardConfig, ctx: StrategyContext | None = None) -> None:
        super().__init__()
        self.reward_cfg = reward_cfg
        self.ctx = ctx
        self.scorer: Any = None

    @register(Dispatch.ALL)
    def initialize(self) -> dict[str, Any]:
        """Load the role's model (if any) and warm the rule functions up."""
        from roll_ds.rewards.model_reward import build_role_scorer

        with timeline.phase("initialize"):
            self.scorer = build_role_scorer(self.reward_cfg, self.ctx)
            self.scorer.warmup()
        return {"rank": self.rank, **started_profile()}

    @register(Dispatch.ALL)
    def close(self) -> None:
        """Stop the scorer's processes and servers (``Worker.close``: why)."""
        scorer, self.scorer = self.scorer, None
        if scorer is not None:
            scorer.close()
        super().close()

    @register(Dispatch.DP)
    def score(self, batch: Batch) -> Batch:
        rows = [
            {"prompt": p, "ground_truth": g}
            for p, g in zip(batch["prompt"], batch["ground_truth"], strict=True)
        ]
        result = self.scorer.score(rows, list(batch["response_text"]))
        # plain floats: a rule-based reward process never imports torch (its start is ~2 s
        # less CPU); the driver makes them a tensor (pipeline/scoring.py)
        scores = [float(x) for x in result["scores"]]
        return Batch(non_tensors={"scores": scores, "reward_info": result["infos"]})
