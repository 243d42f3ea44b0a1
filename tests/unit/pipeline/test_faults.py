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
    recovery = watch_stateless(
        cfg, clusters, Choreography(plan or ColocationPlan()), lambda cluster, ranks: None
    )
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


def test_async_engines_are_watched_and_colocated_roles_are_left_to_stop_the_run():
    for mode in ("batch", "stream"):
        cfg = RLVRConfig()
        cfg.async_generation.max_staleness, cfg.async_generation.mode = 1, mode
        assert _watched(cfg)["actor_infer"] and _watched(cfg)["rewards.math"]
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


def test_a_restore_asked_from_a_rollout_thread_runs_when_the_main_thread_serves():
    """``MainThreadRestore``: on its own thread the restore runs at once; from another thread
    the caller waits until the owner serves it (and raises what it raised there); ``close``
    ends a wait nobody will serve."""
    import threading

    from roll_ds.pipeline.faults import MainThreadRestore

    ran: list[tuple[str, list[int]]] = []

    def restore(cluster, ranks):
        if ranks == [9]:
            raise ValueError("parity gap")
        ran.append((threading.current_thread().name, ranks))

    broker = MainThreadRestore(restore)
    broker("engines", [0])
    assert ran == [(threading.current_thread().name, [0])]
    errors: list[BaseException] = []

    def ask(ranks):
        try:
            broker("engines", ranks)
        except BaseException as exc:
            errors.append(exc)

    waiters = [threading.Thread(target=ask, args=([r],)) for r in (1, 9)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(0.2)
        assert w.is_alive()  # nothing served yet
    threading.Thread(target=broker.serve).start()  # serve off the owner thread: a no-op
    while any(w.is_alive() for w in waiters):
        broker.serve()
        for w in waiters:
            w.join(0.01)
    assert ran[1] == (threading.current_thread().name, [1])  # on the owner thread
    assert len(errors) == 1 and "parity gap" in str(errors[0])
    late = threading.Thread(target=ask, args=([2],))
    late.start()
    late.join(0.2)
    broker.close()
    late.join(5)
    assert not late.is_alive() and "ended before the engine was restored" in str(errors[-1])


def test_a_replaced_stream_engine_gets_its_share_of_the_requests_again():
    """Stream mode: the requests a dead engine held died with it. The collect call's
    ``before_resend`` submits the same batch (tag, seed, sampling) to that rank alone before
    the collect is sent to it again (the cluster below stands in for Ray: its collect call
    runs the hook as ``PendingCall.get`` does after a replacement of rank 1)."""
    from roll_ds.agentic.runner import TurnRequest
    from roll_ds.distributed.batch import Batch
    from roll_ds.pipeline.engines import RolloutEngines

    sent: list[tuple] = []
    out = Batch(
        non_tensors={
            "row": [0, 1],
            "response_ids": [[7], [8]],
            "rollout_logprobs": [[-0.5], [-0.25]],
            "finish_reason": ["stop", "stop"],
            "token_versions": [[3], [4]],
        }
    )

    class Call:
        def __init__(self, method, hook=None):
            self.method, self.hook = method, hook

        def get(self, timeout_s=None):
            if self.method == "collect_stream":
                self.hook(1)
                return [out]
            return None

    class Cluster:
        name = "actor_infer"

        def call(self, method, *args, **kwargs):
            sent.append((method, args, kwargs))

        def submit(self, method, *args, _ranks=None, _before_resend=None, **kwargs):
            sent.append((method, args, {**kwargs, "_ranks": _ranks}))
            return Call(method, _before_resend)

    engines = RolloutEngines(Cluster())
    requests = [
        TurnRequest(context=[1, 2], n=1, seed=5, index=0, max_new_tokens=4),
        TurnRequest(context=[3], n=1, seed=5, index=1, max_new_tokens=4),
    ]
    samples, _ = engines.generate(requests, {"temperature": 0.8}, stream=True)
    assert [s[0].ids for s in samples] == [[7], [8]]
    (first, batch, kw), (collect, tag, _), (again, batch2, kw2) = sent
    assert (first, collect, again) == ("submit_stream", "collect_stream", "submit_stream")
    assert batch2 == batch and kw2 == {**kw, "_ranks": [1]}  # the same requests, rank 1 only
    assert kw["tag"] == tag[0] and kw["seed"] == 5 and kw["temperature"] == 0.8
