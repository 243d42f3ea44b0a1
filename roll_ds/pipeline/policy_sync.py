"""The sync phase: the trainer's policy into the rollout engines, then the parity probe.

``PolicySync`` tracks which policy version the engines serve (``rollout_version``; None: never
synced), builds the weight transport (``roll_ds.weight_sync``) on the first sync, and after
each sync compares the engines' log-probs with the trainer's on a few train prompts
(``weight_sync.parity_check``); a gap above the bound stops the run. Under
``async_generation.mode=stream`` the engines' request streams are paused for the transfer and
resumed with the new version's label (``strategies/vllm/stream.py``); the parity probe then
runs beside the requests in flight.

A sync the step's rollout follows at once (``sync(..., defer_parity=True)``: the synchronous
loop, engines not colocated) leaves the engines' side of the probe to the rollout's generate
call: the trainer scores the probe beside the generation, the engines in the same engine steps as
the rollout, and the rollout phase calls ``finish_parity`` before anything trains on it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from roll_ds.config.schema import RLVRConfig
from roll_ds.pipeline.colocation import GENERATE, SYNC, Choreography, colocated_parity
from roll_ds.pipeline.sync_gate import SyncGate


class PolicySync:
    """The sync phase over ``clusters`` (``actor_train`` -> ``actor_infer``); ``train_rows``
    hold the parity probe's prompts."""

    def __init__(
        self,
        cfg: RLVRConfig,
        clusters: Mapping[str, Any],
        colocation: Choreography,
        train_rows: list[dict],
        pad_id: int,
    ) -> None:
        self.cfg = cfg
        self.clusters = clusters
        self.colocation = colocation
        self.train_rows = train_rows
        self.pad_id = pad_id
        self.rollout_version: int | None = None  # the version the engines last received
        self.last_parity: float | None = None  # max |delta| of the latest parity probe
        self.transport: Any = None  # built once, on the first sync
        self.parity_probe: Any = None
        self.pending: Any = None  # a DeferredParity the next generate call completes
        # Generate calls of threads playing ahead wait while a sync has the engines.
        self.gate = SyncGate()

    @property
    def streaming(self) -> bool:
        """``async_generation.mode=stream``: generation goes on around each sync."""
        ag = self.cfg.async_generation
        return ag.mode == "stream" and ag.max_staleness > 0

    @property
    def actor_train(self) -> Any:
        return self.clusters["actor_train"]

    @property
    def actor_infer(self) -> Any:
        return self.clusters["actor_infer"]

    def sync(self, policy_version: int, *, defer_parity: bool = False) -> dict[str, float]:
        """Gather the policy's full weights from the ZeRO shards into every rollout engine (one
        reload each, prefix cache dropped), then check parity. Returns ``sync/*`` metrics:
        seconds, bytes, gbps, ... and ``sync/parity_max_abs_diff`` / ``_mean_abs_diff``; empty
        when the engines already serve the trainer's version. ``defer_parity`` (not
        colocated): the parity metrics come from ``finish_parity`` instead (module doc)."""
        if self.rollout_version == policy_version and not self.colocation.needs_sync:
            return {}
        metrics = self._transfer(policy_version, defer_parity)
        self.rollout_version = policy_version
        return metrics

    def finish_parity(self, rollout_BT_per_worker: list[Any]) -> dict[str, float]:
        """Complete the deferred parity check with the engines' probe log-probs (one tensor per
        rollout worker, from their generate call); raises ``WeightSyncParityError`` above the
        bound."""
        pending, self.pending = self.pending, None
        metrics = pending.finish(rollout_BT_per_worker)
        self.last_parity = metrics["sync/parity_max_abs_diff"]
        return metrics

    def _transfer(self, policy_version: int, defer_parity: bool = False) -> dict[str, float]:
        from roll_ds.weight_sync.select import build_transport

        ws = self.cfg.weight_sync
        if self.transport is None:
            self.transport = build_transport(
                ws,
                self.actor_train,
                self.actor_infer,
                rollout_dtype=self.cfg.actor_infer.model_args.dtype,
            )
        with self.gate.sync():  # turns played ahead wait; those in flight finish first
            self.colocation.enter(SYNC, policy_version)  # trainer loaded, engine weights awake
            if self.streaming:  # requests in flight wait between two decode steps
                started = time.perf_counter()
                self.actor_infer.call("pause_generation")
                paused_s = time.perf_counter() - started
            metrics = self.transport.sync(self.actor_train, self.actor_infer)
            if self.streaming:
                self.actor_infer.call("resume_generation", policy_version)
                metrics["sync/pause_s"] = paused_s
        self.colocation.synced(policy_version)
        self.last_parity = None
        self.pending = None  # a probe of the weights just replaced is moot
        if ws.parity_check:
            checked = self._parity(metrics, policy_version, defer_parity)
            metrics.update(checked)
            self.last_parity = checked.get("sync/parity_max_abs_diff")
        return metrics

    def _parity(
        self, sync_metrics: dict[str, float], policy_version: int, defer: bool
    ) -> dict[str, float]:
        """vLLM's vs the trainer's log-probs on the first ``parity_probe_size`` train prompts;
        a gap above ``weight_sync.parity_max_abs_diff`` (default: by dtype) stops the run.
        ``defer``: started here, completed by ``finish_parity`` (no metrics yet)."""
        from roll_ds.weight_sync.parity import (
            check_parity,
            default_max_abs_diff,
            defer_parity,
            probe_batch,
        )

        ws, cfg = self.cfg.weight_sync, self.cfg
        if self.parity_probe is None:
            rows = [r["prompt_ids"] for r in self.train_rows if len(r["prompt_ids"]) >= 2]
            self.parity_probe = probe_batch(rows[: ws.parity_probe_size], self.pad_id)
        dtypes = (cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype)
        bound = ws.parity_max_abs_diff
        if bound is None:
            bound = default_max_abs_diff(*dtypes)
        what = (
            f"{int(sync_metrics.get('sync/num_tensors', 0))} tensors, trainer "
            f"{dtypes[0]} -> {self.actor_infer.name} {dtypes[1]}"
        )
        if defer and not self.colocation.active:
            self.pending = defer_parity(
                self.actor_train, self.actor_infer, self.parity_probe, max_abs_diff=bound, what=what
            )
            return {}
        if self.colocation.active:  # the trainer scores, leaves the GPU, then the engines do
            return colocated_parity(
                self.actor_train,
                self.actor_infer,
                self.parity_probe,
                max_abs_diff=bound,
                what=what,
                between=lambda: self.colocation.enter(GENERATE, policy_version),
            )
        return check_parity(
            self.actor_train, self.actor_infer, self.parity_probe, max_abs_diff=bound, what=what
        )
