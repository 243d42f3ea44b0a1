"""ResourceManager.wait_free: a restart waits (bounded) for Ray to free what the teardown held;
an agentic run's restart checked at once and found 1 of 3 CPUs free."""

from roll_ds.distributed import resource_manager
from roll_ds.distributed.resource_manager import ResourceManager


def test_waits_until_the_resources_come_back(monkeypatch):
    frees = iter([{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 3.0}])
    monkeypatch.setattr(resource_manager.ray, "available_resources", lambda: next(frees))
    monkeypatch.setattr(resource_manager.time, "sleep", lambda s: None)
    assert ResourceManager.wait_free({"CPU": 2.0}, timeout_s=60)


def test_gives_up_at_the_bound(monkeypatch):
    monkeypatch.setattr(resource_manager.ray, "available_resources", lambda: {"CPU": 1.0})
    assert not ResourceManager.wait_free({"CPU": 2.0, "GPU": 1.0}, timeout_s=0.3)
