"""The sync phase: the trainer's policy into the rollout engines, then the parity check.

``PolicySync`` tracks which policy version the engines serve (``rollout_version``; None: never
synced), builds the weight transport (``roll_ds.weight_sync``) on the first sync, and checks that
the engines' log-probs equal the trainer's on a few fixed prompts (``weight_sync.parity_check``;
a gap above the bound stops the run). Under ``async_generation.mode=stream`` the engines'
request streams are paused for the transfer and resumed with the new version's label.

How the parity check runs is chosen once, at start (``parity_mode``):

    off          weight_sync.parity_check: false
    colocated    the trainer scores the probe, leaves the GPU, then the engines score it
    on_rollout   the synchronous loop on engines that score a probe inside generate: the
                 trainer scores it beside the rollout, the engines in the same engine steps
                 as the step's first generate call (no separate pass after every sync); the
                 rollout phase hands the engines' log-probs back (``finish_on_rollout``)
    after_sync   otherwise: both sides score the probe right after the sync
"""

from __future__ import annotations

import time
from typing import Any

from roll_ds.config.schema import RLVRConfig
from roll_ds.config.strategies import STRATEGY_SPECS
from roll_ds.distributed.recovery import failed_ranks
from roll_ds.pipeline.colocation.choreography import GENERATE, SYNC, Choreography
from roll_ds.pipeline.engines import RolloutEngines

OFF, COLOCATED, ON_ROLLOUT, AFTER_SYNC = "off", "colocated", "on_rollout", "after_sync"


def parity_mode(cfg: RLVRConfig, *, colocated: bool) -> str:
    """How the parity check runs in this run (module doc)."""
    if not cfg.weight_sync.parity_check:
        return OFF
    if colocated:
        return COLOCATED
    spec = STRATEGY_SPECS[cfg.actor_infer.strategy_args.strategy_name]
    if cfg.async_generation.max_staleness == 0 and spec.probe_in_generate:
        return ON_ROLLOUT
    return AFTER_SYNC


def dead_engines(exc: Any, engines: Any) -> list[Any]:
    """The errors of the engine ranks that broke a weight sync (``exc.causes``: dead, or
    stuck while the trainer waited on them), if ``engines`` is watched by a ``Recovery`` and no
    trainer rank is among the causes (that is the run's restart, ``pipeline/restarts.py``);
    else none."""
    recovery = getattr(engines, "recovery", None)
    failures = getattr(exc, "causes", ()) or getattr(exc, "failures", ())
    dead = [f for f in failures if recovery is not None and recovery.handles(engines, f)]
    others = [f for f in failures if getattr(f, "role", None) != engines.name]
    return [] if others or not dead else dead


class PolicySync:
    """The sync phase from ``train`` (the ``actor_train`` cluster) into ``engines``;
    ``probe_prompts`` hold the parity probe's prompts (token ids)."""

    def __init__(
        self,
        cfg: RLVRConfig,
        train: Any,
        engines: RolloutEngines,
        colocation: Choreography,
        probe_prompts: list[list[int]],
        pad_id: int,
    ) -> None:
        self.cfg = cfg
        self.train = train
        self.engines = engines
        self.colocation = colocation
        self.probe_prompts = probe_prompts
        self.pad_id = pad_id
        self.mode = parity_mode(cfg, colocated=colocation.active)
        ag = cfg.async_generation
        self.streaming = ag.mode == "stream" and ag.max_staleness > 0
        self.rollout_version: int | None = None  # the version the engines last received
        self.last_parity: float | None = None  # max |delta| of the latest parity check
        self.transport: Any = None  # built once, on the first sync
        self._probe: Any = None
        self._deferred: Any = None  # on_rollout: the trainer's side, waiting for the rollout
        self._rollout_metrics: dict[str, float] = {}

    def sync(self, policy_version: int, *, before_rollout: bool = False) -> dict[str, float]:
        """Gather the policy's full weights from the ZeRO shards into every rollout engine (one
        reload each, prefix cache dropped), then check parity. Returns ``sync/*`` metrics;
        empty when the engines already serve ``policy_version``. ``before_rollout``: the
        step's rollout follows at once (``on_rollout`` parity may ride on it)."""
        if self.rollout_version == policy_version and not self.colocation.needs_sync:
            return {}
        if self.transport is None:
            self.transport = self._build_transport()
        self.colocation.enter(SYNC, policy_version)  # trainer loaded, engine weights awake
        if self.streaming:  # requests in flight wait between two decode steps
            started = time.perf_counter()
            self.engines.pause()
            paused_s = time.perf_counter() - started
        metrics = self._transfer()
        if self.streaming:
            self.engines.resume(policy_version)
            metrics["sync/pause_s"] = paused_s
        self.colocation.synced(policy_version)
        self.rollout_version = policy_version
        self.last_parity, self._deferred = None, None  # a probe of replaced weights is moot
        metrics.update(self._check(metrics, policy_version, before_rollout))
        return metrics

    def _transfer(self) -> dict[str, float]:
        """The transport's sync; an engine that dies in it (the engines' cluster watched by
        a ``Recovery``) is replaced and the full sync done again into every engine, over a
        transport connected anew (a collective one re-forms its group with the new engine)."""
        from roll_ds.weight_sync.base import WeightSyncError

        cluster = self.engines.cluster
        since = time.monotonic()
        try:
            return self.transport.sync(self.train, cluster)
        except WeightSyncError as exc:
            dead = dead_engines(exc, cluster)
            if not dead:
                raise
            # Held until the new engines have the weights: a rollout thread that finds its
            # engine replaced sends it work only then.
            with cluster.recovery.locked():
                # the old group is left before the dead are replaced: their ranks are skipped
                self._drop_transport(cluster, [r for e in dead for r in failed_ranks(e)])
                for error in dead:  # restored by the sync redone below
                    cluster.recovery.replace(cluster, error, since, restore=False)
                self.transport = self._build_transport()  # connects the new ranks
                return self.transport.sync(self.train, cluster)

    def _build_transport(self) -> Any:
        from roll_ds.weight_sync.select import build_transport

        return build_transport(
            self.cfg.weight_sync,
            self.train,
            self.engines.cluster,
            rollout_dtype=self.cfg.actor_infer.model_args.dtype,
        )

    def _drop_transport(self, cluster: Any, dead: list[int]) -> None:
        """The trainer and the surviving engines leave the transport (a collective one seated
        the ``dead`` engine ranks in its group; the next ``_build_transport`` re-forms it with
        their replacements); ``dead`` are not called. Bounded: a survivor or trainer rank that
        cannot leave (dead too, or stuck) fails it with ``WeightSyncError`` naming the rank."""
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.close(self.train, cluster, dead=dead)

    def restore_engines(self, cluster: Any, ranks: list[int], version: int | None = None) -> None:
        """Replaced engine ranks (``pipeline/faults.py``) get the trainer's weights: a full
        sync into every engine, parity checked, before their call is sent again, over a
        transport connected anew (the old one left without the replaced ranks). ``version``:
        the trainer's (default: the version the engines serve, which the synchronous loop's
        trainer holds whenever the engines work). A parity probe riding on that call still
        completes the step's check. Metrics under ``faults/actor_infer/`` (the step's own
        ``sync/*`` stay those of its sync)."""
        if self.rollout_version is None:
            return  # never synced yet: the step's sync fills every engine
        version = self.rollout_version if version is None else version
        deferred = self._deferred
        self._drop_transport(cluster, ranks)
        self.rollout_version = None
        metrics = self.sync(version)
        self._deferred = deferred
        prefix = f"faults/{cluster.name}/"
        for key in ("sync/seconds", "sync/parity_max_abs_diff"):
            if key in metrics:
                self._rollout_metrics[prefix + key] = metrics[key]

    # --- parity ------------------------------------------------------------------------------

    def rollout_probe(self) -> dict | None:
        """The probe the next generate call should score (``on_rollout``, once per sync)."""
        return None if self._deferred is None else self._deferred.probe

    def finish_on_rollout(self, rollout_BT_per_worker: list[Any]) -> None:
        """Complete the ``on_rollout`` check with the engines' probe log-probs; raises
        ``WeightSyncParityError`` above the bound. Its metrics come with ``pop_metrics``."""
        deferred, self._deferred = self._deferred, None
        metrics = deferred.finish(rollout_BT_per_worker)
        self.last_parity = metrics["sync/parity_max_abs_diff"]
        self._rollout_metrics.update(metrics)

    def pop_metrics(self) -> dict[str, float]:
        """The parity metrics a rollout completed since the last call."""
        metrics, self._rollout_metrics = self._rollout_metrics, {}
        return metrics

    def _check(
        self, sync_metrics: dict[str, float], policy_version: int, before_rollout: bool
    ) -> dict[str, float]:
        from roll_ds.weight_sync.parity import (
            check_parity,
            colocated_parity,
            default_max_abs_diff,
            defer_parity,
            probe_batch,
        )

        if self.mode == OFF:
            return {}
        cfg, ws = self.cfg, self.cfg.weight_sync
        if self._probe is None:
            rows = [p for p in self.probe_prompts if len(p) >= 2][: ws.parity_probe_size]
            self._probe = probe_batch(rows, self.pad_id)
        dtypes = (cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype)
        bound = ws.parity_max_abs_diff
        if bound is None:
            bound = default_max_abs_diff(*dtypes)
        what = (
            f"{int(sync_metrics.get('sync/num_tensors', 0))} tensors, trainer "
            f"{dtypes[0]} -> {self.engines.name} {dtypes[1]}"
        )
        infer = self.engines.cluster
        if self.mode == ON_ROLLOUT and before_rollout:
            self._deferred = defer_parity(
                self.train, infer, self._probe, max_abs_diff=bound, what=what
            )
            return {}
        if self.mode == COLOCATED:  # the trainer scores, leaves the GPU, then the engines do
            checked = colocated_parity(
                self.train,
                infer,
                self._probe,
                max_abs_diff=bound,
                what=what,
                between=lambda: self.colocation.enter(GENERATE, policy_version),
            )
        else:
            checked = check_parity(self.train, infer, self._probe, max_abs_diff=bound, what=what)
        self.last_parity = checked["sync/parity_max_abs_diff"]
        return checked
