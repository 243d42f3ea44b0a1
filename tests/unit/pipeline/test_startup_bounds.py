"""A role's ``initialize`` is start-up: it waits at least the cluster's ``start_timeout_s``,
whatever ``fault_tolerance.call_timeout_s`` is (lowered to catch a stuck rank sooner, it made
a restart fail while every role loaded at once on a busy box)."""

from __future__ import annotations

from roll_ds.pipeline.colocation.choreography import Choreography
from roll_ds.pipeline.colocation.plan import ColocationPlan
from roll_ds.pipeline.startup import initialize_roles


class FakeCluster:
    """Records the bound each ``initialize`` was waited with."""

    def __init__(self, call_timeout_s: float | None, start_timeout_s: float = 300.0) -> None:
        self.call_timeout_s, self.start_timeout_s = call_timeout_s, start_timeout_s
        self.waited: list[float | None] = []
        self.infos: list[dict] = []
        self.started = False

    def wait_started(self) -> None:
        self.started = True

    def submit(self, method: str):
        assert method == "initialize"
        cluster = self

        class Pending:
            def __init__(self) -> None:
                self.cluster = cluster

            def get(self, timeout_s=None):
                cluster.waited.append(timeout_s)

        return Pending()


def test_initialize_waits_the_start_bound_or_the_call_bound_whichever_is_longer():
    clusters = {
        "actor_train": FakeCluster(call_timeout_s=45.0),  # a hang bound lowered for a test
        "reference": FakeCluster(call_timeout_s=3600.0),  # the default: longer than start-up
        "rewards.math": FakeCluster(call_timeout_s=None, start_timeout_s=120.0),
    }
    colocation = Choreography(ColocationPlan(), run=lambda *a, **k: None)
    initialize_roles(clusters, colocation, list(clusters))
    assert clusters["actor_train"].waited == [300.0]
    assert clusters["reference"].waited == [3600.0]
    assert clusters["rewards.math"].waited == [120.0]
    assert all(c.started for c in clusters.values())  # asked for at once, waited for here
