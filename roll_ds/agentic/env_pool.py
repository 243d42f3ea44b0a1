"""Environments off the driver: ``EnvHost`` holds many environments and steps them concurrently,
each step bounded by ``step_timeout_s``; ``EnvPool`` spreads episodes over hosts running as Ray
actors (``RayEnvPool``) or, for tests and tools, in this process (``LocalEnvPool``).

A step that raises, or is still running at its timeout, ends that episode with status
``error`` / ``timeout`` (the environment's fault; the run goes on; a hung step's thread is
abandoned, as a daemon).

A host actor that dies (killed, OOM, its node gone) or stops answering is the host's fault, not
its environments': ``RayEnvPool`` kills it, starts a new one with the same environment specs
in its place, and answers ``lost`` for every episode the dead host held, in that call and in
any later call made for an episode reset before the replacement (another rollout thread's,
under ``async_generation``). The runner (``runner.py``) then plays those episodes again from
their start on the new host, with the same environment seed and the same generation seeds, so
in the synchronous loop it gets the episodes the dead host would have given. Replacements are
bounded by ``fault_tolerance.max_restarts`` over the run (``EnvHostLost`` past it); two threads
that find the same host dead replace it once. ``pop_metrics``: ``faults/env_hosts/restarts``
and ``faults/env_hosts/lost_s`` (the wall time of the thrown-away work: from the reset of the
dead host's oldest open episode to its replacement being up).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_ds.agentic.env import Env, as_messages
from roll_ds.agentic.kill_hook import kill_if_asked

logger = logging.getLogger(__name__)

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
LOST = "lost"  # the host holding the episode died or stuck: play it again (module doc)
ROLE = "env_hosts"  # the name faults/<role>/* metrics and errors give the hosts


@dataclass(frozen=True)
class EnvTypeSpec:
    """How to build one tag's environments: the registry name and its keyword arguments."""

    env_type: str
    env_config: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class EnvReply:
    """A reset's or a step's outcome for one episode. ``observation`` is chat messages."""

    observation: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    status: str = OK
    error: str = ""
    seconds: float = 0.0
    tools: list[dict[str, Any]] | None = None  # reset only: the environment's tool schemas


class _Call:
    """One environment call handed to a worker thread, and its outcome once it has one."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.status, self.value, self.seconds = TIMEOUT, None, 0.0
        self.done = threading.Event()

    def run(self) -> None:
        started = time.perf_counter()
        try:
            self.status, self.value = OK, self.fn()
        except BaseException:  # an environment's failure is data, whatever it raised
            self.status, self.value = ERROR, traceback.format_exc(limit=4)
        self.seconds = time.perf_counter() - started
        self.done.set()


class _Workers:
    """Daemon threads that run environment calls, kept between calls (starting two threads
    per call cost more than a small environment's step). A call past its deadline is answered
    as a timeout and its thread abandoned: it keeps running, as a daemon, and a new thread
    takes its place."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def _loop(self) -> None:
        while True:
            call = self._queue.get()
            call.run()
            with self._lock:
                self._idle += 1

    def run_all(self, fns: list, timeout_s: float) -> list[tuple[str, Any, float]]:
        """Every ``fn`` at once; ``(status, value or error text, seconds)`` each, a call still
        running ``timeout_s`` after the batch began answered as a timeout."""
        calls = [_Call(fn) for fn in fns]
        with self._lock:  # one thread per call in flight: start what the idle ones miss
            missing = max(0, len(calls) - self._idle)
            self._idle = max(0, self._idle - len(calls))
        for _ in range(missing):
            threading.Thread(target=self._loop, daemon=True).start()
        started = time.perf_counter()
        for call in calls:
            self._queue.put(call)
        results = []
        for call in calls:
            left = timeout_s - (time.perf_counter() - started)
            if call.done.wait(max(0.0, left)):
                results.append((call.status, call.value, call.seconds))
            else:
                seconds = time.perf_counter() - started
                results.append((TIMEOUT, f"no answer within step_timeout_s={timeout_s:g}", seconds))
        return results


class EnvHost:
    """Many environments in one process, stepped concurrently (one worker thread per step in
    flight, kept between steps)."""

    def __init__(self, specs: Mapping[str, EnvTypeSpec], step_timeout_s: float) -> None:
        self.specs = dict(specs)
        self.step_timeout_s = step_timeout_s
        self.envs: dict[int, Env] = {}
        self._workers = _Workers()

    def _build(self, tag: str) -> Env:
        from roll_ds.agentic.registry import env_class

        spec = self.specs[tag]
        return env_class(spec.env_type)(**dict(spec.env_config))

    def reset(self, items: Sequence[tuple[int, str, int]]) -> list[EnvReply]:
        """``(episode_id, tag, seed)`` each: a new environment, reset to ``seed``."""

        def one(episode_id: int, tag: str, seed: int):
            def run():
                env = self._build(tag)
                self.envs[episode_id] = env
                return as_messages(env.reset(seed)), list(getattr(env, "tools", []) or [])

            return run

        replies = []
        for (episode_id, _, _), (status, value, seconds) in zip(
            items, self._all([one(*item) for item in items]), strict=True
        ):
            if status == OK:
                messages, tools = value
                replies.append(EnvReply(observation=messages, tools=tools, seconds=seconds))
            else:
                self.envs.pop(episode_id, None)
                replies.append(EnvReply(status=status, error=value, seconds=seconds))
        return replies

    def step(self, items: Sequence[tuple[int, str]]) -> list[EnvReply]:
        """``(episode_id, action text)`` each, stepped concurrently."""
        kill_if_asked()  # a test hook, inert unless its variable is set (kill_hook.py)

        def one(episode_id: int, action: str):
            def run():
                result = self.envs[episode_id].step(action)
                return as_messages(result.observation), result

            return run

        replies = []
        for (episode_id, _), (status, value, seconds) in zip(
            items, self._all([one(*item) for item in items]), strict=True
        ):
            if status == OK:
                messages, result = value
                replies.append(
                    EnvReply(
                        observation=messages,
                        reward=float(result.reward),
                        done=bool(result.done),
                        info=dict(result.info),
                        seconds=seconds,
                    )
                )
            else:
                self.envs.pop(episode_id, None)  # a failed or hung environment is not reused
                replies.append(EnvReply(status=status, error=value, seconds=seconds))
        return replies

    def close(self, episode_ids: Sequence[int]) -> None:
        for episode_id in episode_ids:
            env = self.envs.pop(episode_id, None)
            if env is not None:
                with contextlib.suppress(Exception):  # closing is best effort
                    env.close()

    def _all(self, fns: list) -> list[tuple[str, Any, float]]:
        """Every ``fn`` at once, each bounded by the step timeout."""
        return self._workers.run_all(fns, self.step_timeout_s)


class LocalEnvPool:
    """One ``EnvHost`` in this process (tests, evaluation tools): it never dies alone."""

    max_restarts = 0

    def __init__(self, specs: Mapping[str, EnvTypeSpec], step_timeout_s: float) -> None:
        self.host = EnvHost(specs, step_timeout_s)

    def reset(self, items: Sequence[tuple[int, str, int]]) -> list[EnvReply]:
        return self.host.reset(items)

    def step(self, items: Sequence[tuple[int, str]]) -> list[EnvReply]:
        return self.host.step(items)

    def close(self, episode_ids: Sequence[int]) -> None:
        self.host.close(episode_ids)

    def shutdown(self) -> None:
        self.host.close(list(self.host.envs))

    def pop_metrics(self) -> dict[str, float]:
        return {}


HOST_MARGIN_S = 60.0  # Ray's own latency on a busy box, beyond a host call's step_timeout_s


class EnvHostLost(RuntimeError):
    """An environment host died or stopped answering, with ``fault_tolerance.max_restarts``
    replacements spent."""


class RayEnvPool:
    """``num_workers`` ``EnvHost`` actors; episode ``i`` lives on host ``i % num_workers``, and
    every host steps its share at the same time as the others. A dead or stuck host is replaced
    at most ``max_restarts`` times over the pool's life (module doc)."""

    def __init__(
        self,
        specs: Mapping[str, EnvTypeSpec],
        step_timeout_s: float,
        num_workers: int = 1,
        max_restarts: int = 0,
    ) -> None:
        import ray

        self._ray = ray
        self._actor_cls = ray.remote(num_cpus=0, max_restarts=0)(EnvHost)
        self.specs = dict(specs)
        self.step_timeout_s = step_timeout_s
        self.max_restarts = max_restarts
        self.hosts = [self._new_host() for _ in range(num_workers)]
        self.restarts = 0
        self._lost_s = 0.0
        # episode id -> (the host actor it was reset on, when): an episode whose host was
        # replaced since is lost without asking the new host, which never had it
        self._open: dict[int, tuple[Any, float]] = {}
        self._lock = threading.Lock()  # one replacement at a time (rollout threads share us)

    def _new_host(self) -> Any:
        return self._actor_cls.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote(
            self.specs, self.step_timeout_s
        )

    def _scatter(self, method: str, items: Sequence[tuple]) -> list[EnvReply]:
        replies: list[EnvReply] = [EnvReply()] * len(items)
        hosts = list(self.hosts)  # what this call sees, whatever other threads replace meanwhile
        shards: dict[int, list[int]] = {}
        now = time.perf_counter()
        for i, item in enumerate(items):
            h = item[0] % len(hosts)
            if method == "reset":
                self._open[item[0]] = (hosts[h], now)
            elif item[0] in self._open and self._open[item[0]][0] is not hosts[h]:
                replies[i] = EnvReply(status=LOST, error=f"environment host {h} was replaced")
                continue
            shards.setdefault(h, []).append(i)
        calls = {
            h: (hosts[h], getattr(hosts[h], method).remote([items[i] for i in idx]))
            for h, idx in shards.items()
        }
        # A host answers within step_timeout_s (each call is bounded there); past that plus a
        # margin for Ray it is stuck: treated as dead, not waited on forever.
        bound_s = self.step_timeout_s + HOST_MARGIN_S
        for h, (host, call) in calls.items():
            try:
                out = self._ray.get(call, timeout=bound_s)
            except (
                self._ray.exceptions.RayActorError,
                self._ray.exceptions.GetTimeoutError,
            ) as exc:
                why = "died" if isinstance(exc, self._ray.exceptions.RayActorError) else "stuck"
                self._replace(h, host, why, exc)
                error = f"environment host {h} {why}: {_first_line(exc)}"
                out = [EnvReply(status=LOST, error=error)] * len(shards[h])
            for i, reply in zip(shards[h], out, strict=True):
                replies[i] = reply
        return replies

    def _replace(self, h: int, dead: Any, why: str, exc: BaseException) -> None:
        """Host ``h`` (the actor ``dead``) in a new actor, unless another thread did it."""
        with self._lock:
            if self.hosts[h] is not dead:
                return  # replaced since this call was sent
            if self.restarts >= self.max_restarts:
                raise EnvHostLost(
                    f"{ROLE}: environment host {h} {why} ({_first_line(exc)}); "
                    f"{self.restarts} of fault_tolerance.max_restarts={self.max_restarts} "
                    f"replacements used; raise it to replace more"
                ) from exc
            logger.warning(
                "%s: environment host %d %s (%s); replacing in place (%d of %d)",
                ROLE,
                h,
                why,
                _first_line(exc),
                self.restarts + 1,
                self.max_restarts,
            )
            with contextlib.suppress(Exception):  # a stuck one is still alive
                self._ray.kill(dead, no_restart=True)
            self.hosts[h] = self._new_host()  # its environments are gone with it
            self.restarts += 1
            started = [t for host, t in list(self._open.values()) if host is dead]
            if started:
                self._lost_s += time.perf_counter() - min(started)

    def reset(self, items: Sequence[tuple[int, str, int]]) -> list[EnvReply]:
        return self._scatter("reset", items)

    def step(self, items: Sequence[tuple[int, str]]) -> list[EnvReply]:
        return self._scatter("step", items)

    def close(self, episode_ids: Sequence[int]) -> None:
        for episode_id in episode_ids:
            self._open.pop(episode_id, None)
        for h, host in enumerate(self.hosts):
            mine = [e for e in episode_ids if e % len(self.hosts) == h]
            if mine:
                host.close.remote(mine)

    def shutdown(self) -> None:
        for host in self.hosts:
            self._ray.kill(host)
        self.hosts = []
        self._open = {}

    def pop_metrics(self) -> dict[str, float]:
        """``faults/env_hosts/restarts`` (over the run, from the first replacement on) and
        ``faults/env_hosts/lost_s`` (since the last call)."""
        with self._lock:
            metrics = {f"faults/{ROLE}/restarts": float(self.restarts)} if self.restarts else {}
            if self._lost_s:
                metrics[f"faults/{ROLE}/lost_s"] = self._lost_s
            self._lost_s = 0.0
        return metrics


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
