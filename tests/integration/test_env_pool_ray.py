"""Environment workers as Ray actors: episodes spread over hosts and stepped concurrently, a
hung step times out, a dead host ends its episodes with an error and is replaced."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from roll_ds.agentic.env_pool import ERROR, OK, TIMEOUT, EnvTypeSpec, RayEnvPool

pytestmark = pytest.mark.integration

HERE = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def ray_session():
    import ray

    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


def test_guess_number_episodes_over_two_hosts(ray_session):
    pool = RayEnvPool({"g": EnvTypeSpec("guess_number", {})}, step_timeout_s=10, num_workers=2)
    replies = pool.reset([(i, "g", i) for i in range(8)])
    assert all(r.status == OK and r.observation[0]["role"] == "user" for r in replies)
    replies = pool.step([(i, "8") for i in range(8)])
    assert all(r.status == OK for r in replies)
    pool.shutdown()


def test_hung_step_times_out_and_dead_host_is_replaced(ray_session):
    import ray

    pool = RayEnvPool(
        {"s": EnvTypeSpec("_envs:Sleepy", {"seconds": 0.5})}, step_timeout_s=2, num_workers=2
    )
    assert all(r.status == OK for r in pool.reset([(i, "s", i) for i in range(8)]))
    started = time.perf_counter()
    replies = pool.step([(i, "hang" if i == 3 else "go") for i in range(8)])
    elapsed = time.perf_counter() - started
    assert [r.status for r in replies].count(TIMEOUT) == 1 and replies[3].status == TIMEOUT
    assert all(r.reward == 1.0 for i, r in enumerate(replies) if i != 3)
    # 8 steps of 0.5 s on 2 hosts ran together (one after another would be 4 s, plus the 2 s
    # timeout)
    assert elapsed < 3.5
    ray.kill(pool.hosts[0])
    replies = pool.step([(0, "go"), (1, "go")])
    assert replies[0].status == ERROR and "died" in replies[0].error
    assert pool.restarts == 1
    assert pool.reset([(0, "s", 0)])[0].status == OK  # the replacement serves new episodes
    pool.shutdown()
