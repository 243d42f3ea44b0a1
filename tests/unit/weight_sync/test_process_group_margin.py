"""The trainers' process-group timeout against the weight-sync bound
(``fault_tolerance.process_group_timeout_s``, ``weight_sync.config_checks.bound_problems``).

While train rank 0 waits up to ``weight_sync.timeout_s`` on a stuck engine, the other train
ranks wait for it in the next bucket's ZeRO-3 gather; torch ends a rank that waits past the
process-group timeout, and the engine's replacement becomes a trainer restart. Shown here with
real gloo groups in threads: two train ranks (their world a gloo group with the process-group
timeout) running the real ``publish_weights``, and a weight-sync group whose engine joined and
then stopped answering. DeepSpeed's default (600 s) equals ``weight_sync.timeout_s``'s.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _members import run_members

torch = pytest.importorskip("torch")

from roll_ds.config import ConfigError, load_config  # noqa: E402
from roll_ds.weight_sync.base import TransferError  # noqa: E402
from roll_ds.weight_sync.config_checks import PROCESS_GROUP_MARGIN_S  # noqa: E402
from roll_ds.weight_sync.group import GroupSpec, TransferGroup, open_store  # noqa: E402
from roll_ds.weight_sync.worker import SenderWorkerMixin  # noqa: E402

BUCKETS = 4


class GatheringStrategy:
    """A ZeRO-3 trainer's weights at the collective boundary: every bucket is first gathered
    over the trainers' world (an all-reduce there), as ``GatheredParameters`` does."""

    zero_stage = 3

    def __init__(self, world: TransferGroup) -> None:
        self.world = world

    def named_weights_for_sync(self, bucket_bytes: int) -> Any:
        for k in range(BUCKETS):
            self.world.barrier(f"gather of bucket {k}")  # TransferError past the timeout
            yield [(f"w{k}", torch.full((64,), float(k)))]


class TrainRank(SenderWorkerMixin):
    def __init__(self, rank: int, world: TransferGroup) -> None:
        self.rank, self.local_rank, self.strategy = rank, 0, GatheringStrategy(world)


def group(world: int, timeout_s: float) -> tuple[Any, GroupSpec]:
    store, host, port = open_store(timeout_s)
    return store, GroupSpec(host, port, world, "gloo", timeout_s, prefix=f"t/{time.monotonic_ns()}")


def sync_with_a_stuck_engine(sync_s: float, process_group_s: float) -> dict[int, Any]:
    """Train ranks 0 and 1 publish; the engine (weight-sync rank 1) joined and stopped."""
    world_store, world_spec = group(2, process_group_s)
    stores = {0: world_store, 1: None}  # rank 0 hosts the store, rank 1 connects to it
    worlds = run_members(
        {
            r: (lambda r=r: TransferGroup(world_spec, r, device="cpu", store=stores[r]))
            for r in (0, 1)
        }
    )
    assert all(isinstance(w, TransferGroup) for w in worlds.values()), worlds
    ranks = {r: TrainRank(r, worlds[r]) for r in (0, 1)}
    host, port = ranks[0].weight_sync_open("collective", sync_s)
    spec = GroupSpec(host, port, 2, "gloo", sync_s, prefix=f"ws/{time.monotonic_ns()}")
    joined = run_members(
        {
            0: lambda: ranks[0].weight_sync_join("collective", {0: spec}),
            1: lambda: TransferGroup(spec, 1, device="cpu"),  # the engine; it never receives
        }
    )
    engine = joined[1]
    assert isinstance(engine, TransferGroup), joined
    try:
        return run_members(
            {r: (lambda r=r: ranks[r].publish_weights("collective", 1 << 20)) for r in (0, 1)},
            timeout_s=30,
        )
    finally:
        ranks[0].weight_sync_leave()
        engine.close()
        for w in worlds.values():
            w.close()


def test_the_defaults_scaled_down_keep_an_engine_replacement_a_replacement():
    """The default config, its timeouts scaled to a 1 s sync bound: rank 0's sync fails on the
    stuck engine (the replacement's cue) and rank 1 outlasts the wait in its gather."""
    cfg = load_config("rlvr_lora_zero3", check_files=False)
    scale = 1.0 / cfg.weight_sync.timeout_s
    out = sync_with_a_stuck_engine(1.0, cfg.fault_tolerance.process_group_timeout_s * scale)
    assert isinstance(out[0], TransferError) and "rank 0/2" in str(out[0]), out
    assert out[1] is None, out  # rank 1 walked every gather: the trainer lives on


def test_a_process_group_timeout_below_the_sync_bound_fails_the_other_train_rank():
    """What DeepSpeed's default did (600 s, as weight_sync.timeout_s): the rank waiting in the
    gather times out first, and a trainer rank failing its call restarts the run."""
    out = sync_with_a_stuck_engine(1.0, 0.5)
    assert isinstance(out[1], TransferError) and "gather of bucket 1" in str(out[1]), out


def test_validation_refuses_a_sync_bound_within_the_margin_naming_both_fields():
    load_config("rlvr_lora_zero3", check_files=False)  # the defaults pass
    with pytest.raises(ConfigError) as info:
        load_config(
            "rlvr_lora_zero3",
            ["weight_sync.timeout_s=600", "fault_tolerance.process_group_timeout_s=600"],
            check_files=False,
        )
    (problem,) = [p for p in info.value.problems if "process_group_timeout_s" in p]
    assert problem.startswith("weight_sync.timeout_s (600) must be at least 300 s below")
    assert f"to {600 + PROCESS_GROUP_MARGIN_S:g} or more" in problem
    assert "lower weight_sync.timeout_s to 300 or less" in problem
