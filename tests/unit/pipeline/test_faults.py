"""Which roles a run replaces in place (roll_ds/pipeline/faults.py) and the bounds it gives the
calls; the clusters are stand-ins carrying only a name (nothing is called)."""

from __future__ import annotations

from types import SimpleNamespace

from roll_ds.config.schema import RLVRConfig
from roll_ds.pipeline.colocation.choreography import Choreography
from roll_ds.pipeline.colocation.plan import ColocationPlan
from roll_ds.pipeline.faults import call_bounds, watch_stateless

ROLES = ("actor_train", "critic", "actor_infer", "reference", "rewards.math", "rewards.judge")


def _watched(cfg: RLVRConfig, plan: ColocationPlan | None = None, size: int = 1) -> dict[str, bool]:
    clusters = {name: SimpleNamespace(name=name, recovery=None, world_size=size) for name in ROLES}
    sync = SimpleNamespace(restore_engines=lambda cluster, ranks: None)
    recovery = watch_stateless(cfg, clusters, Choreography(plan or ColocationPlan()), sync)
    return {name: c.recovery is recovery for name, c in clusters.items()}


def test_stateless_roles_are_watched_and_trainers_are_not():
    assert _watched(RLVRConfig()) == {
        "actor_train": False,
        "critic": False,
        "actor_infer": True,
        "reference": True,
        "rewards.math": True,
        "rewards.judge": True,
    }


def test_max_restarts_0_watches_nothing():
    cfg = RLVRConfig()
    cfg.fault_tolerance.max_restarts = 0
    assert not any(_watched(cfg).values())


def test_async_engines_and_colocated_roles_are_left_to_stop_the_run():
    cfg = RLVRConfig()
    cfg.async_generation.max_staleness = 1
    assert not _watched(cfg)["actor_infer"] and _watched(cfg)["rewards.math"]
    plan = ColocationPlan(engines=("actor_infer",), trainers=("actor_train", "reference"))
    watched = _watched(RLVRConfig(), plan)
    assert not watched["actor_infer"] and not watched["reference"] and watched["rewards.judge"]


def test_a_reference_of_several_deepspeed_ranks_is_not_replaced():
    from roll_ds.config.schema import WorkerConfig

    cfg = RLVRConfig()
    cfg.reference = WorkerConfig()
    cfg.reference.strategy_args.strategy_name = "deepspeed_infer"
    assert _watched(cfg)["reference"]  # one rank: no group to rejoin
    assert not _watched(cfg, size=2)["reference"]


def test_generate_bounds_grow_with_the_tokens():
    cfg = RLVRConfig()
    cfg.fault_tolerance.call_timeout_s, cfg.fault_tolerance.per_token_s = 100.0, 0.5
    assert call_bounds(cfg).tokens(0) == 100.0
    assert call_bounds(cfg).tokens(40) == 120.0


def test_a_generate_call_waits_for_its_tokens():
    """Each engine call's bound: base + per token of its prompts and max_new_tokens x n."""
    from roll_ds.agentic.runner import TurnRequest
    from roll_ds.distributed.batch import Batch
    from roll_ds.distributed.recovery import CallBounds
    from roll_ds.pipeline.engines import RolloutEngines

    waited = []

    class Call:
        def get(self, timeout_s=None):
            waited.append(timeout_s)
            return Batch(
                non_tensors={
                    "row": [],
                    "response_ids": [],
                    "rollout_logprobs": [],
                    "finish_reason": [],
                }
            )

    cluster = SimpleNamespace(name="actor_infer", submit=lambda *a, **k: Call())
    engines = RolloutEngines(cluster, CallBounds(base_s=10.0, per_token_s=1.0))
    requests = [
        TurnRequest(context=[1, 2, 3], n=2, seed=0, index=0, max_new_tokens=5),
        TurnRequest(context=[4], n=2, seed=0, index=1, max_new_tokens=5),
    ]
    engines.generate(requests, {"temperature": 1.0})
    assert waited == [10.0 + 2 * (3 + 5 + 1 + 5)]
