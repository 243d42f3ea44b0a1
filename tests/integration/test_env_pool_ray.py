"""Environment workers as Ray actors: episodes spread over hosts and stepped concurrently, a
hung step times out; a host SIGKILLed mid-episode is replaced and its episodes played again
from their start (the same episodes an uninterrupted run plays), at most
``fault_tolerance.max_restarts`` times; an environment that raises is still an error."""

from __future__ import annotations

import os
import random
import signal
import time
import zlib
from pathlib import Path

import pytest

from roll_ds.agentic.env_pool import (
    ERROR,
    LOST,
    OK,
    TIMEOUT,
    EnvHostLost,
    EnvTypeSpec,
    LocalEnvPool,
    RayEnvPool,
)
from roll_ds.agentic.runner import EpisodeRunner, EpisodeSpec, TurnLimits, one_sample_each

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


def test_hung_step_times_out_and_a_dead_host_is_replaced(ray_session):
    import ray

    pool = RayEnvPool(
        {"s": EnvTypeSpec("_envs:Sleepy", {"seconds": 0.5})},
        step_timeout_s=2,
        num_workers=2,
        max_restarts=1,
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
    assert replies[0].status == LOST and "died" in replies[0].error
    assert replies[1].status == OK  # the other host's episode is not touched
    assert pool.restarts == 1
    assert pool.reset([(0, "s", 0)])[0].status == OK  # the replacement serves new episodes
    pool.shutdown()


GUESS = {"guess": EnvTypeSpec("guess_number", {"low": 1, "high": 16})}


def host_pid(ray, host) -> int:
    return ray.get(host.__ray_call__.remote(lambda _: os.getpid()))


class SeededPolicy:
    """Guesses from ``(seed, index, context)`` only, as a per-request seeded engine samples;
    ``before(call)`` runs before each call (the test's kill)."""

    def __init__(self, tokenizer, before=lambda call: None) -> None:
        self.tok, self.before, self.calls = tokenizer, before, 0

    def __call__(self, contexts, max_new_tokens, indices, seed):
        self.calls += 1
        self.before(self.calls)
        ids, lps = [], []
        for context, index in zip(contexts, indices, strict=True):
            key = zlib.crc32(str((seed, index, context)).encode())
            guess = self.tok(str(random.Random(key).randint(1, 16)), add_special_tokens=False)
            ids.append([*guess["input_ids"], self.tok.eos_token_id])
            lps.append([-(key % 97) / 100.0] * len(ids[-1]))
        return {"response_ids": ids, "rollout_logprobs": lps}


def play(pool, policy):
    specs = [EpisodeSpec(i, i // 2, "guess", 300 + i // 2) for i in range(8)]
    runner = EpisodeRunner(
        tokenizer=policy.tok,
        pool=pool,
        generate=one_sample_each(policy),
        limits={"guess": TurnLimits(5, 8)},
        max_context_tokens=200,
    )
    episodes, timings = runner.run(specs, seed=5)
    keep = ("prompt_ids", "token_ids", "policy_mask", "logprobs", "turn_rewards", "turns")
    return [{k: getattr(e, k) for k in (*keep, "status", "success")} for e in episodes], timings


def test_a_host_sigkilled_mid_episode_is_replaced_and_its_episodes_replayed_exactly(ray_session):
    """Host 0 of 2 SIGKILLed before the third turn: its episodes still running start over on
    a new host with the same seeds, and every episode equals the uninterrupted run's. Then, on
    the same pool (the actors' start-up is this test's cost): an episode reset on a host
    replaced since (another thread found it dead) is lost without asking the new host; an
    environment that raises is its own error, not a lost host; a death past ``max_restarts``
    stops naming the field."""
    from transformers import AutoTokenizer

    from roll_ds.models.shipped import EMBEDDED_MODEL, resolve_embedded

    tok = AutoTokenizer.from_pretrained(resolve_embedded(EMBEDDED_MODEL))
    tok.chat_template = (
        "{%- for m in messages -%}<|im_start|>{{ m['content'] }}<|im_end|>{%- endfor -%}"
    )
    want, _ = play(LocalEnvPool(GUESS, 10.0), SeededPolicy(tok))
    assert sum(len(w["turn_rewards"]) > 2 for w in want) >= 4  # the kill lands mid-episode
    specs = {**GUESS, "crash": EnvTypeSpec("_envs:Crashing", {})}
    pool = RayEnvPool(specs, step_timeout_s=10, num_workers=2, max_restarts=2)
    killed = []

    def kill_host_0(call: int) -> None:
        if call == 3:
            killed.append(host_pid(ray_session, pool.hosts[0]))
            os.kill(killed[0], signal.SIGKILL)

    got, timings = play(pool, SeededPolicy(tok, kill_host_0))
    assert killed and got == want
    # host 0 held the even ids; those still running after two turns were played again
    running = [i for i, w in enumerate(want) if i % 2 == 0 and len(w["turn_rewards"]) > 2]
    assert timings["redone"] == len(running) > 0
    metrics = pool.pop_metrics()
    assert metrics["faults/env_hosts/restarts"] == 1.0 and metrics["faults/env_hosts/lost_s"] > 0
    assert pool.pop_metrics() == {"faults/env_hosts/restarts": 1.0}  # lost_s is per step
    assert host_pid(ray_session, pool.hosts[0]) != killed[0]

    assert all(r.status == OK for r in pool.reset([(i, "guess", i) for i in range(4)]))
    os.kill(host_pid(ray_session, pool.hosts[0]), signal.SIGKILL)
    assert [r.status for r in pool.step([(0, "8"), (1, "8")])] == [LOST, OK]
    assert pool.restarts == 2
    assert pool.step([(2, "8")])[0].status == LOST  # reset on the dead host
    assert pool.restarts == 2  # found replaced: not replaced again
    assert pool.reset([(2, "guess", 2)])[0].status == OK
    assert pool.step([(2, "8")])[0].status == OK  # played again on the new host
    assert pool.reset([(9, "crash", 9)])[0].status == OK
    reply = pool.step([(9, "8")])[0]
    assert reply.status == ERROR and "always fails" in reply.error and pool.restarts == 2
    os.kill(host_pid(ray_session, pool.hosts[1]), signal.SIGKILL)
    with pytest.raises(EnvHostLost, match=r"2 of fault_tolerance.max_restarts=2"):
        pool.step([(3, "8")])
    pool.shutdown()
