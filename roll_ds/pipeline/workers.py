"""The Ray actor classes of the RLVR roles: each hosts one strategy (or a reward scorer).

Methods carry their dispatch mode: ``DP`` methods get this rank's share of a ``Batch`` and
return a ``Batch`` the cluster concatenates in rank order; ``ALL`` methods run on every rank.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from roll_ds.config.schema import RewardConfig, WorkerConfig
from roll_ds.distributed.batch import Batch
from roll_ds.distributed.dispatch import Dispatch, register
from roll_ds.distributed.worker import Worker
from strategies.base import STRATEGIES, StrategyContext


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
        cls = STRATEGIES.get(self.role_cfg.strategy_args.strategy_name)
        self.strategy = cls.from_worker_config(self.role_cfg, self.ctx, **self.STRATEGY_KWARGS)
        self.strategy.initialize()
        return {"rank": self.rank}

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
    def offload_states(self) -> None:
        self.strategy.offload_states()

    @register(Dispatch.ALL)
    def reload_states(self) -> None:
        self.strategy.reload_states()


class TrainWorker(StrategyWorker):
    """A rank of a role that trains on the rollout batch (actor_train, critic)."""

    @register(Dispatch.DP, even=True)
    def train_step(self, batch: Batch, loss_fn: Any) -> dict[str, float]:
        tensors = dict(batch.tensors)
        return self.strategy.train_step(
            tensors, loss_fn, with_entropy=getattr(loss_fn, "needs_entropy", False)
        )

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


class ActorTrainWorker(TrainWorker):
    # --- weight sync (sender side; see roll_ds.weight_sync) ---------------------------------

    @register(Dispatch.ALL)
    def publish_weights(
        self,
        transport: str,
        bucket_bytes: int,
        *,
        rollout_dtype: str | None = None,
        adapter_only: bool = False,
    ) -> dict[str, Any] | None:
        """Gather the full weights (``adapter_only``: the LoRA adapter alone) bucket by bucket
        and send them by ``transport`` from rank 0; under ZeRO-3 the other ranks join every
        bucket's gather. Rank 0 returns its send stats (``object_store``: with the bucket
        references), the others None."""
        from roll_ds.weight_sync.base import cast_buckets

        start = time.perf_counter()
        if adapter_only:
            buckets = self.strategy.adapter_buckets_for_sync(bucket_bytes)
        else:
            buckets = self.strategy.named_weights_for_sync(bucket_bytes)
        if self.rank != 0:
            if getattr(self.strategy, "zero_stage", 3) == 3:
                for _ in buckets:
                    pass
            return None
        buckets = cast_buckets(buckets, rollout_dtype)
        if transport == "object_store":
            from roll_ds.weight_sync.object_store import put_buckets

            stats = put_buckets(buckets)
        else:
            from roll_ds.weight_sync.collective import send_stream

            group, plane = self._joined_group(transport)
            stats = send_stream(group, buckets, plane)
        stats["seconds"] = time.perf_counter() - start
        stats["gather_seconds"] = stats["seconds"] - stats["transfer_seconds"]
        return stats

    @register(Dispatch.RANK0)
    def adapter_config(self) -> dict[str, Any]:
        """The policy's LoRA config (``weight_sync.lora_sync: adapter``)."""
        return self.strategy.adapter_config()

    @register(Dispatch.RANK0)
    def weight_sync_open(self, timeout_s: float) -> tuple[str, int]:
        """Host the weight-sync group's store; returns its ``(host, port)``."""
        from roll_ds.weight_sync.collective import open_store

        self.weight_sync_leave()
        self._sync_store, host, port = open_store(timeout_s)
        return host, port

    @register(Dispatch.RANK0)
    def weight_sync_join(self, plane: str, spec: Any) -> None:
        """Join the group opened by ``weight_sync_open`` as its rank 0 (the sender)."""
        from roll_ds.platform import current_platform
        from roll_ds.weight_sync.collective import TransferGroup, make_plane

        store = getattr(self, "_sync_store", None)
        if store is None:
            raise RuntimeError("weight_sync_join before weight_sync_open")
        device = current_platform().device(self.local_rank)
        group = TransferGroup(spec, 0, device=device, store=store)
        self._sync_group = (group, make_plane(plane), plane)

    @register(Dispatch.RANK0)
    def weight_sync_leave(self) -> None:
        joined = getattr(self, "_sync_group", None)
        self._sync_group = self._sync_store = None
        if joined is not None:
            joined[1].close()
            joined[0].close()

    def _joined_group(self, transport: str) -> tuple[Any, Any]:
        joined = getattr(self, "_sync_group", None)
        if joined is None:
            raise RuntimeError(
                f"weight sync by {transport!r}: this worker has joined no weight-sync group (the "
                "transport's connect() builds it)"
            )
        return joined[0], joined[1]

    @register(Dispatch.ALL)
    def export_hf(self, path: str) -> dict[str, str]:
        return self.strategy.export_hf(path)


class RolloutWorker(StrategyWorker):
    @register(Dispatch.DP)
    def generate(self, batch: Batch, *, seed: int, **sampling: Any) -> Batch:
        """``n`` samples per prompt (``prompt_ids`` column); rows come back grouped by prompt."""
        prompts = list(batch["prompt_ids"])
        # Each prompt is seeded by its index in the whole batch, so what it samples does not
        # depend on how the prompts were split over the rollout workers.
        first_row = int(batch["row"][0])
        out = self.strategy.generate(prompts, seed=seed, first_prompt_index=first_row, **sampling)
        rows = [first_row + i for i in out["prompt_index"]]
        return Batch(
            non_tensors={
                "row": rows,
                "response_ids": out["response_ids"],
                "rollout_logprobs": out["logprobs"],
                "finish_reason": out["finish_reason"],
            }
        )

    # --- weight sync (receiver side; see roll_ds.weight_sync) -------------------------------

    @property
    def _is_vllm(self) -> bool:
        return getattr(self.strategy, "llm", None) is not None

    @register(Dispatch.ALL)
    def load_weights(self, refs: list[Any]) -> dict[str, Any]:
        """``object_store``: read the buckets behind ``refs`` into one reload."""
        from roll_ds.weight_sync.object_store import iter_refs

        start = time.perf_counter()
        stats = self.strategy.load_weights(iter_refs(refs)) or {}
        return {**stats, "seconds": time.perf_counter() - start}

    @register(Dispatch.ALL)
    def enable_adapter_sync(self, config: dict[str, Any]) -> None:
        """``weight_sync.lora_sync: adapter``: syncs from now on carry the LoRA adapter."""
        enable = getattr(self.strategy, "enable_adapter_sync", None)
        if enable is None:
            raise ValueError(
                f"weight_sync.lora_sync=adapter: the {type(self.strategy).__name__} rollout "
                "strategy cannot serve a LoRA adapter; use actor_infer strategy vllm or "
                "lora_sync=merged"
            )
        enable(config)

    @register(Dispatch.ALL)
    def inference_worker_count(self) -> int:
        """Receivers this rank brings to a weight-sync group (its vLLM workers)."""
        if self._is_vllm:
            return len(self.strategy.llm.collective_rpc("roll_ds_worker_rank"))
        return 1

    @register(Dispatch.ALL)
    def weight_sync_join(self, plane: str, spec: Any, offsets: list[int]) -> list[int]:
        """Join the group: this rank's receivers take ranks from ``offsets[rank]`` on."""
        offset = offsets[self.rank]
        if self._is_vllm:
            args = (plane, spec, offset)
            return self.strategy.llm.collective_rpc("roll_ds_join_transfer_group", args=args)
        from roll_ds.platform import current_platform
        from roll_ds.weight_sync.collective import TransferGroup, make_plane

        self.weight_sync_leave()
        group = TransferGroup(spec, offset, device=current_platform().device(self.local_rank))
        self._sync_group = (group, make_plane(plane), plane)
        return [offset]

    @register(Dispatch.ALL)
    def receive_weights(self, plane: str) -> dict[str, Any]:
        """Receive one sync from the group into one reload (per vLLM worker), then drop the
        prefix cache."""
        start = time.perf_counter()
        if self._is_vllm:
            stats = self.strategy.receive_weights(plane)
        else:
            from roll_ds.weight_sync.collective import ReceiveStream, receive_into

            joined = getattr(self, "_sync_group", None)
            if joined is None or joined[2] != plane:
                raise RuntimeError(f"receive_weights({plane!r}) before joining such a group")
            stream = ReceiveStream(joined[0], joined[1])
            stats = {**(receive_into(self.strategy.load_weights, stream) or {}), **stream.stats()}
        return {**stats, "seconds": time.perf_counter() - start}

    @register(Dispatch.ALL)
    def weight_sync_leave(self) -> None:
        if self._is_vllm:
            self.strategy.llm.collective_rpc("roll_ds_leave_transfer_group")
            return
        joined = getattr(self, "_sync_group", None)
        self._sync_group = None
        if joined is not None:
            joined[1].close()
            joined[0].close()

    @register(Dispatch.ALL)
    def probe_logprobs(self, batch: Batch) -> Any:
        """Log-probs ``[B, T-1]`` of the *whole* probe on this rank (weight-sync parity)."""
        out = self.strategy.compute_logprobs(
            batch["input_ids"], batch["attention_mask"], with_entropy=False
        )
        return out["logprobs_BT"].float().cpu()


class RewardWorker(Worker):
    """A rank of a reward role: scores responses of its domains with rule-based reward fns."""

    def __init__(self, reward_cfg: RewardConfig) -> None:
        super().__init__()
        from roll_ds.rewards.scorer import RewardScorer

        self.scorer = RewardScorer(reward_cfg)
        self.scorer.warmup()

    @register(Dispatch.DP)
    def score(self, batch: Batch) -> Batch:
        rows = [
            {"prompt": p, "ground_truth": g}
            for p, g in zip(batch["prompt"], batch["ground_truth"], strict=True)
        ]
        result = self.scorer.score(rows, list(batch["response_text"]))
        import torch

        return Batch(
            {"scores": torch.tensor(result["scores"], dtype=torch.float32)},
            {"reward_info": result["infos"]},
        )
