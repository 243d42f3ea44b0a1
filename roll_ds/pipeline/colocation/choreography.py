"""Colocation memory choreography: which role holds device memory in which phase of a step.

When the trainer roles (``actor_train``, and ``reference`` / ``critic`` where they share the
devices) and the rollout engines (``actor_infer``, a backend with a sleep mode: ``sleeps`` in
its ``StrategySpec``, vLLM or hf_infer) share GPUs, only one side holds its states on the GPU
at a time:

    start     the engines start first and profile a GPU nobody else touches (vLLM measures
              its KV cache from the device's free memory, so a trainer loading beside it
              shrinks the cache or trips vLLM's profiling assertion), then sleep; then the
              trainers start. (OpenRLHF does the same: ``create_vllm_engines`` sleeps them
              before the actor loads.)
    sync      the sender (actor_train) loaded, the engines' weights woken, KV cache still
              asleep: the gathered buckets and vLLM's weights fit beside the trainer
    generate  the trainers offloaded, the engines fully awake (KV cache re-allocated after the
              trainer left): rollouts, evaluation, the engines' half of the parity probe
    train     the engines asleep (``sleep_level`` 1: weights to host memory, KV cache freed;
              2: both freed, the next sync refills the weights), the trainers loaded:
              log-probs, training, checkpoints, export

hf_infer sleeps the same way (its weights to host memory at either level; HF ``generate``
holds no KV cache between calls, so its ``kv_cache`` tag only tracks the state), and it has no
share of the GPU to size at start, so the vLLM memory checks (``plan.py``) do not apply to it.

The pipeline says which phase it is about to enter (``Choreography.enter``); the choreography
makes only the transitions that phase needs, frees before it allocates, runs the transitions
of one kind on all roles at once, and records every transition in ``trace`` (role, action,
step). Orders that would serve or overwrite the wrong memory raise: a weight sync into sleeping
weights (``synced`` outside the sync phase), generating with weights that a level-2 sleep
discarded and no sync refilled, entering a phase before the roles started.

Who is managed, and in which order the roles start, is the plan's (``plan.py``). This module
imports neither torch nor Ray: the roles' calls go through a ``Runner``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from roll_ds.pipeline.colocation.plan import ColocationPlan

logger = logging.getLogger(__name__)

TRAIN, SYNC, GENERATE = "train", "sync", "generate"
PHASES = (TRAIN, SYNC, GENERATE)
SENDER = "actor_train"  # the role whose weights a sync gathers: loaded in the sync phase
WEIGHTS, KV_CACHE = "weights", "kv_cache"
ALL_TAGS = frozenset((WEIGHTS, KV_CACHE))
# What each phase needs: (trainers that hold their states, tags the engines hold).
_NEEDS: dict[str, tuple[Callable[[str], bool], frozenset[str]]] = {
    TRAIN: (lambda role: True, frozenset()),
    SYNC: (lambda role: role == SENDER, frozenset((WEIGHTS,))),
    GENERATE: (lambda role: False, ALL_TAGS),
}
TRACE_FILE = "colocation_trace.jsonl"


# --- transitions (pure) --------------------------------------------------------------------


@dataclass(frozen=True)
class Transition:
    """One call on every rank of ``role``: ``method(**kwargs)`` of its workers."""

    role: str
    action: str  # offload | reload | sleep | wake | wake_weights | wake_kv_cache
    method: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ColocationState:
    """What each managed role holds on its devices now."""

    loaded: dict[str, bool]  # trainer -> its states are on the device
    awake: dict[str, frozenset[str]]  # engine -> the sleep tags it holds
    discarded: set[str] = field(default_factory=set)  # engines whose weights a level-2 sleep
    # dropped and no sync has refilled since

    @classmethod
    def started(cls, plan: ColocationPlan) -> ColocationState:
        return cls(
            loaded={t: True for t in plan.trainers}, awake={e: ALL_TAGS for e in plan.engines}
        )


def phase_transitions(
    plan: ColocationPlan, state: ColocationState, phase: str
) -> list[list[Transition]]:
    """The transitions from ``state`` into ``phase``, in stages run one after the other (the
    transitions of a stage run at once): first the ones that free memory, then the ones that
    allocate it."""
    if phase not in PHASES:
        raise ValueError(f"unknown colocation phase {phase!r}; valid: {', '.join(PHASES)}")
    keeps_loaded, tags = _NEEDS[phase]
    frees: list[Transition] = []
    allocs: list[Transition] = []
    for role in plan.trainers:
        want = keeps_loaded(role)
        if state.loaded[role] and not want:
            frees.append(Transition(role, "offload", "offload_states"))
        elif want and not state.loaded[role]:
            allocs.append(Transition(role, "reload", "reload_states"))
    for role in plan.engines:
        awake = state.awake[role]
        if awake - tags:  # vLLM sleeps as a whole: sleep, then wake what the phase needs
            frees.append(sleep_transition(role, plan.sleep_level))
            awake = frozenset()
        missing = tags - awake
        if missing == ALL_TAGS:
            allocs.append(Transition(role, "wake", "reload_states"))
        elif missing:
            (tag,) = missing
            allocs.append(Transition(role, f"wake_{tag}", "reload_states", {"tags": [tag]}))
    return [stage for stage in (frees, allocs) if stage]


def sleep_transition(role: str, level: int) -> Transition:
    return Transition(role, "sleep", "offload_states", {"level": level})


def apply(state: ColocationState, transition: Transition, sleep_level: int) -> None:
    """Update ``state`` for a transition that has run."""
    role, action = transition.role, transition.action
    if action in ("offload", "reload"):
        state.loaded[role] = action == "reload"
    elif action == "sleep":
        state.awake[role] = frozenset()
        if sleep_level == 2:
            state.discarded.add(role)
    elif action == "wake":
        state.awake[role] = ALL_TAGS
    else:
        state.awake[role] = state.awake[role] | {action.removeprefix("wake_")}


# --- the state machine ---------------------------------------------------------------------


class TraceEntry(NamedTuple):
    step: int | None  # the policy version (train steps taken); None: start-up
    role: str  # a role, or "pipeline" for the phase the pipeline entered
    action: str


Runner = Callable[[Sequence[Transition]], Sequence[Any] | None]
"""Runs transitions (on different roles) at once and waits for all of them. Returns, per
transition, what its call returned (the ranks' device memory after it: ``StrategyWorker``'s
``offload_states`` / ``reload_states``), or None."""

MIB = 2**20


def peak_memory(ranks_result: Any) -> dict[str, int] | None:
    """The largest of each memory figure over a role's ranks (``{"allocated", "reserved",
    "device_used"}`` in bytes, one dict per rank, None on CPU); None when no rank reported."""
    ranks = ranks_result if isinstance(ranks_result, (list, tuple)) else [ranks_result]
    figures = [r for r in ranks if isinstance(r, Mapping)]
    if not figures:
        return None
    return {key: max(int(f[key]) for f in figures) for key in figures[0]}


class ColocationError(RuntimeError):
    """An order of phases that would serve or overwrite the wrong device memory."""


class Choreography:
    """Tracks what each managed role holds and makes the transitions a phase needs."""

    def __init__(
        self, plan: ColocationPlan, run: Runner | None = None, trace_path: Path | None = None
    ) -> None:
        self.plan = plan
        self._run = run
        self.trace: list[TraceEntry] = []
        self.phase: str | None = None  # None until every role has started
        self.state = ColocationState.started(plan)
        self.seconds = 0.0  # spent in transitions since the last pop_seconds()
        # colocation/<role>_<action>_<figure>_mib: each role's device memory after its latest
        # transition (on GPUs; the start-up sleep's too), until pop_memory()
        self.memory: dict[str, float] = {}
        self._pending_start = set(plan.engines) | set(plan.trainers)
        self._trace_path = trace_path if plan.active else None
        if self._trace_path is not None:
            self._trace_path.parent.mkdir(parents=True, exist_ok=True)
            self._trace_path.write_text("")  # this process's choreography, from its start
        for note in plan.notes:
            logger.info("colocation: %s", note)

    @property
    def active(self) -> bool:
        return self.plan.active

    @property
    def needs_sync(self) -> bool:
        """True when an engine's weights were discarded (sleep level 2) since the last sync:
        the next generation needs a sync even if the engines hold the trainer's version."""
        return bool(self.state.discarded)

    def start_stages(self, roles: Iterable[str]) -> list[list[str]]:
        return self.plan.start_stages(roles)

    def started(self, roles: Iterable[str]) -> None:
        """``roles`` have initialized: managed engines among them go to sleep right away, so
        the trainers that start next find their GPUs free."""
        roles = list(roles)
        for role in roles:
            self._record(None, role, "start")
        engines = [r for r in roles if r in self.plan.engines]
        if engines:
            self._execute(None, [sleep_transition(e, self.plan.sleep_level) for e in engines])
        self._pending_start -= set(roles)
        if self.active and not self._pending_start:
            self.phase = TRAIN

    def enter(self, phase: str, step: int) -> None:
        """Make the transitions ``phase`` needs (none when already in it, or inactive)."""
        if not self.active or phase == self.phase:
            return
        if self.phase is None:
            raise ColocationError(
                f"colocation: entering {phase!r} before {sorted(self._pending_start)} started"
            )
        if phase == GENERATE and self.state.discarded:
            raise ColocationError(
                f"colocation: {', '.join(sorted(self.state.discarded))} would generate with "
                "weights that colocation.sleep_level=2 discarded and no sync has refilled; "
                "sync the weights first (the pipeline does when needs_sync is true)"
            )
        self._record(step, "pipeline", phase)
        for stage in phase_transitions(self.plan, self.state, phase):
            self._execute(step, stage)
        self.phase = phase

    def synced(self, step: int) -> None:
        """A weight sync into the engines has completed (call right after it)."""
        if not self.active:
            return
        asleep = [e for e in self.plan.engines if WEIGHTS not in self.state.awake[e]]
        if asleep:
            raise ColocationError(
                f"colocation: a weight sync went into {', '.join(asleep)} while its weights "
                "were asleep; enter the 'sync' phase before syncing"
            )
        for engine in self.plan.engines:
            self._record(step, engine, "synced")
        self.state.discarded.clear()

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def pop_memory(self) -> dict[str, float]:
        """The memory metrics since the last call (empty on CPU)."""
        memory, self.memory = self.memory, {}
        return memory

    def _execute(self, step: int | None, stage: Sequence[Transition]) -> None:
        if self._run is None:
            raise ColocationError("colocation: no runner to make transitions with")
        started = time.perf_counter()
        results = self._run(stage) or [None] * len(stage)
        self.seconds += time.perf_counter() - started
        for transition, result in zip(stage, results, strict=True):
            apply(self.state, transition, self.plan.sleep_level)
            memory = peak_memory(result)
            self._record(step, transition.role, transition.action, memory)
            for key, value in (memory or {}).items():
                name = f"colocation/{transition.role}_{transition.action}_{key}_mib"
                self.memory[name] = value / MIB

    def _record(
        self, step: int | None, role: str, action: str, memory: dict[str, int] | None = None
    ) -> None:
        """One trace entry; the trace file's line also carries the role's device memory after
        the transition (MiB, on GPUs)."""
        entry = TraceEntry(step, role, action)
        self.trace.append(entry)
        logger.debug("colocation: step %s %s %s %s", step, role, action, memory or "")
        if self._trace_path is not None:
            row: dict[str, Any] = entry._asdict()
            if memory:
                row["memory_mib"] = {k: round(v / MIB, 3) for k, v in memory.items()}
            with open(self._trace_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def cluster_runner(clusters: Mapping[str, Any]) -> Runner:
    """A ``Runner`` over the pipeline's role clusters (``Cluster.submit`` on every rank)."""

    def run(stage: Sequence[Transition]) -> list[Any]:
        calls = [clusters[t.role].submit(t.method, **t.kwargs) for t in stage]
        return [call.get() for call in calls]

    return run
