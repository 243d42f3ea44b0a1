"""Cluster: one role = ``world_size`` Worker actors, placed by the ResourceManager, called with
dispatch modes, failing loudly.

    rm = ResourceManager(roles, num_gpus_per_node=2)
    actor = Cluster("actor_train", ActorWorker, rm, env=cfg.actor_train.system_envs)
    actor.init_process_group()             # Dispatch.ALL
    out = actor.compute_log_probs(batch)   # Dispatch.DP: split across ranks, concatenated back

Failures: every call waits with ``ray.wait`` and raises at the *first* failed rank -- a
``WorkerError`` naming role, rank, node and the original exception -- without waiting for the
others (which may be stuck in a collective with the dead rank). Ray reports a killed or crashed
actor to pending calls within about a second. ``call_timeout_s`` (or ``_timeout_s=`` per call)
bounds calls on live-but-stuck workers; start-up is always bounded by ``start_timeout_s``.

Stateless roles: with a ``Recovery`` watching the cluster (``recovery.py``), a rank that dies or
passes its bound is replaced in place (``replace_rank``: a new actor on the same bundle) and its
share of the call sent again, inside ``PendingCall.get``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from roll_ds import timeline
from roll_ds.distributed.dispatch import DispatchSpec, collect, dispatch_spec, split_call
from roll_ds.distributed.errors import ClusterError, WorkerError, WorkerTimeoutError
from roll_ds.distributed.resource_manager import ActorPlacement, ResourceManager
from roll_ds.distributed.shm import ShmLedger
from roll_ds.distributed.teardown import (
    CLOSE_TIMEOUT_S,
    close_clusters,
    record_children,
    record_shm,
    retire_ranks,
    sweep_rank_shm,
    sweep_shm,
)
from roll_ds.distributed.worker import Worker, node_probe


class Cluster:
    def __init__(
        self,
        name: str,
        worker_cls: type[Worker] | ActorClass,
        resource_manager: ResourceManager | None = None,
        *,
        placements: Sequence[ActorPlacement] | None = None,
        init_args: tuple = (),
        init_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        num_threads: int | None = None,
        start_timeout_s: float = 300.0,
        call_timeout_s: float | None = None,
        actor_options: Mapping[str, Any] | None = None,
        wait: bool = True,
    ) -> None:
        """Start the role's actors and wait (bounded) until every rank answers.

        ``env``: the role's ``system_envs``. ``num_threads``: OMP/MKL/torch threads per actor;
        None: 1 for actors on CPU slots and CPU-only roles, else the CPUs the actor reserved.
        ``actor_options``: extra ``.options()`` for every actor (e.g. ``max_concurrency``).
        ``wait=False``: return once the actors are asked for; ``wait_started()`` waits. Roles
        started so boot at once (the pipeline's start-up), and calls sent meanwhile queue
        behind each actor's ``__init__``.
        """
        self.placements = _role_placements(name, resource_manager, placements)
        self.name = name
        self.worker_cls, actor_cls = _resolve(worker_cls)
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.recovery: Any = None  # a recovery.Recovery replacing dead ranks, or None
        self.infos: list[dict[str, Any]] = []
        self.actors: list[ActorHandle] = []
        self.shm = ShmLedger()  # the /dev/shm files the ranks held (record_shm, shutdown)
        self.children: dict[int, dict[int, int]] = {}  # rank -> its child processes (record_shm)
        self._in_flight: list[tuple[int, ray.ObjectRef]] = []  # (rank, call) not yet seen done
        # How often each rank was replaced: a call sent before a replacement finds its rank's
        # number changed, so callers in several threads replace a dead rank once (recovery.py).
        self.incarnations = [0] * len(self.placements)
        device_resource = resource_manager.plan.device_resource if resource_manager else None

        self._started_at = time.perf_counter()
        self.start_s: float | None = None  # until every rank answered (wait_started)
        self._start_refs: list[ray.ObjectRef] = []
        self.master_node_id, self.master_addr, self.master_port = self._probe_master()
        rank_env = self._role_env(num_threads, device_resource)
        # The role's system_envs go through Ray's runtime_env, so they are set before the worker's
        # module is imported; that costs ~1-2 s per actor start on a 2-core box, so the per-rank
        # variables are set in the actor process right before Worker.__init__ instead.
        self.system_envs = {k: str(v) for k, v in (env or {}).items()}
        runtime_env = {"env_vars": self.system_envs} if self.system_envs else None
        # what replace_rank starts a rank with
        self._start = (actor_cls, rank_env, runtime_env, init_args, init_kwargs or {})
        self._actor_options = dict(actor_options or {})
        try:
            self._start_actors(
                actor_cls, rank_env, runtime_env, init_args, init_kwargs or {}, self._actor_options
            )
            self._start_refs = [a._roll_info.remote() for a in self.actors]
        except BaseException:
            self.shutdown(close_timeout_s=0)  # nothing was built yet: no call to wait for
            raise
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Until every rank's ``Worker.__init__`` returned (``infos`` filled), bounded by
        ``start_timeout_s``; a rank that failed or is late raises, the role shut down."""
        if self.start_s is not None:
            return
        try:
            self.infos = self._gather(
                "__init__", list(range(self.world_size)), self._start_refs, self.start_timeout_s
            )
        except BaseException:
            self.shutdown(close_timeout_s=0)  # nothing was built yet: no call to wait for
            raise
        self.start_s = time.perf_counter() - self._started_at

    # --- starting ------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.placements)

    def _probe_master(self) -> tuple[str, str, int]:
        """Rank 0's node id, IP and a free port there (a tiny task on that node)."""
        first = self.placements[0]
        if first.node_id is not None:
            strategy = NodeAffinitySchedulingStrategy(first.node_id, soft=False)
            task = ray.remote(node_probe).options(num_cpus=0, scheduling_strategy=strategy)
        else:  # CPU-only role: rank 0 goes where the probe found room, pinned there below
            task = ray.remote(node_probe).options(num_cpus=first.options.get("num_cpus", 0))
        try:
            return ray.get(task.remote(), timeout=60)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"{self.name}: could not run a 0-CPU probe task on rank 0's node within 60 s "
                f"(node {first.node_id or 'any'}); is the node alive?"
            ) from None

    def _role_env(self, num_threads: int | None, device_resource: str | None) -> dict[str, str]:
        """The variables every rank gets: threads, role, world size and rank 0's address."""
        rank_env = _thread_env(num_threads, self.placements[0], device_resource)
        rank_env.update(
            ROLL_DS_ROLE=self.name,
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )
        return rank_env

    def _start_actors(
        self,
        actor_cls: ActorClass,
        rank_env: Mapping[str, str],
        runtime_env: dict | None,
        init_args: tuple,
        init_kwargs: Mapping[str, Any],
        actor_options: Mapping[str, Any],
    ) -> None:
        """One actor per placement (appended to ``self.actors`` as it starts)."""
        for p in self.placements:
            self.actors.append(
                self._new_actor(
                    actor_cls, p, rank_env, runtime_env, init_args, init_kwargs, actor_options
                )
            )

    def _new_actor(
        self,
        actor_cls: ActorClass,
        p: ActorPlacement,
        rank_env: Mapping[str, str],
        runtime_env: dict | None,
        init_args: tuple,
        init_kwargs: Mapping[str, Any],
        actor_options: Mapping[str, Any],
    ) -> ActorHandle:
        options = self._options(p, runtime_env)
        options.update(actor_options)
        return actor_cls.options(**options).remote(
            *init_args,
            _roll_ds_env=_rank_env(rank_env, p),
            _roll_ds_env_defaults=dict(p.env_defaults),
            **init_kwargs,
        )

    def replace_rank(self, rank: int) -> None:
        """A new actor for ``rank`` on its placement (the same bundle, node and rank env),
        waited for as at start; the old one is killed first (it may be stuck rather than dead)
        and, once its process is gone, the ``/dev/shm`` files it alone held are swept. The
        caller brings the new rank up (``initialize`` and what the role needs)."""
        info = self.infos[rank] if rank < len(self.infos) else {}
        with contextlib.suppress(Exception):  # already dead: nothing to kill
            ray.kill(self.actors[rank], no_restart=True)
        # its bundle, its files and its GPU memory are free only once its process and the
        # processes it started (vLLM's engine core) are gone (teardown.retire_ranks)
        retire_ranks([(info, self.children.pop(rank, {}))])
        sweep_rank_shm(self.shm, [i for r, i in enumerate(self.infos) if r != rank], info)
        self._in_flight = [(r, ref) for r, ref in self._in_flight if r != rank]
        actor_cls, rank_env, runtime_env, init_args, init_kwargs = self._start
        self.actors[rank] = self._new_actor(
            actor_cls,
            self.placements[rank],
            rank_env,
            runtime_env,
            init_args,
            init_kwargs,
            self._actor_options,
        )
        self.incarnations[rank] += 1
        ref = self.actors[rank]._roll_info.remote()
        self.infos[rank] = self._gather("__init__", [rank], [ref], self.start_timeout_s)[0]

    def call_ranks(
        self, method: str, ranks: Sequence[int], /, *args: Any, **kwargs: Any
    ) -> list[Any]:
        """``method`` on ``ranks`` only, with the same arguments (a replaced rank's bring-up);
        bounded by ``call_timeout_s``; never recovered (a new rank that dies stops)."""
        refs = [getattr(self.actors[r], method).remote(*args, **kwargs) for r in ranks]
        return self._gather(method, list(ranks), refs, self.call_timeout_s)

    def _options(self, p: ActorPlacement, runtime_env: dict | None) -> dict[str, Any]:
        options = dict(p.options)
        if p.slot.rank == 0 and p.node_id is None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                self.master_node_id, soft=False
            )
        options.update(max_restarts=0, max_task_retries=0)
        if runtime_env:
            options["runtime_env"] = runtime_env
        return options

    # --- calling -------------------------------------------------------------------------------

    def __getattr__(self, method: str) -> Any:
        cls = self.__dict__.get("worker_cls")
        if method.startswith("_") or cls is None:
            raise AttributeError(method)
        if not callable(getattr(cls, method, None)):
            raise AttributeError(f"{cls.__name__} (role {self.name}) has no method {method!r}")
        return functools.partial(self.call, method)

    def call(
        self, method: str, /, *args: Any, _timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        """Call ``method`` on the ranks its dispatch mode names and combine the results."""
        return self.submit(method, *args, **kwargs).get(_timeout_s)

    def submit(
        self,
        method: str,
        /,
        *args: Any,
        _ranks: Sequence[int] | None = None,
        _before_resend: Callable[[int], None] | None = None,
        **kwargs: Any,
    ) -> PendingCall:
        """Start a call without waiting (to overlap roles); ``.get()`` it later. ``_ranks``:
        send only these ranks their share (as the whole call would split it: a replaced rank's
        work sent again). ``_before_resend``: what a replaced rank needs before it gets its
        share of this call again (``PendingCall``)."""
        spec = dispatch_spec(self.worker_cls, method)
        calls = split_call(spec, self.world_size, args, kwargs)
        if _ranks is not None:
            calls = [c for c in calls if c[0] in _ranks]
        incarnations = list(self.incarnations)  # before sending: what the call went to
        refs = [getattr(self.actors[r], method).remote(*a, **kw) for r, a, kw in calls]
        ranks = [r for r, _, _ in calls]
        self._in_flight = [*self._unfinished(), *zip(ranks, refs, strict=True)]
        call = PendingCall(self, method, spec, calls, refs, before_resend=_before_resend)
        call.incarnations = {r: incarnations[r] for r in ranks}
        return call

    def _resend(self, method: str, call: tuple[int, tuple, dict[str, Any]]) -> ray.ObjectRef:
        """A rank's share of a call sent again (to the actor now in its place)."""
        rank, args, kwargs = call
        ref = getattr(self.actors[rank], method).remote(*args, **kwargs)
        self._in_flight.append((rank, ref))
        return ref

    def busy_ranks(self) -> set[int]:
        """Ranks with a call of this cluster's that has not returned (running, queued or stuck:
        ``shutdown`` does not wait on their ``close``)."""
        return {rank for rank, _ in self._unfinished()}

    def _unfinished(self) -> list[tuple[int, ray.ObjectRef]]:
        if not self._in_flight:
            return []
        refs = [ref for _, ref in self._in_flight]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        finished = set(done)
        return [(rank, ref) for rank, ref in self._in_flight if ref not in finished]

    def _gather(
        self, method: str, ranks: list[int], refs: list[ray.ObjectRef], timeout_s: float | None
    ) -> list[Any]:
        """Results in order; the first failed rank raises ``WorkerError`` at once."""
        results: list[Any] = [None] * len(refs)
        pending = {ref: i for i, ref in enumerate(refs)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            if not ready:
                late = sorted(ranks[i] for i in pending.values())
                raise WorkerTimeoutError(self.name, method, late, timeout_s or 0.0)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except RayError as exc:
                    raise self._worker_error(ranks[i], method, exc) from exc
        return results

    def _worker_error(self, rank: int, method: str, exc: BaseException) -> WorkerError:
        info = self.infos[rank] if rank < len(self.infos) else {}
        placement = self.placements[rank]
        return WorkerError(
            self.name,
            rank,
            method,
            exc,
            node_id=info.get("node_id") or placement.node_id,
            node_ip=info.get("node_ip") or placement.node_ip,
            pid=info.get("pid"),
        )

    # --- teardown ------------------------------------------------------------------------------

    def record_shm(self) -> None:
        """Remember the ``/dev/shm`` files the ranks (and their child processes) hold now, so
        ``shutdown`` can remove them even if a rank dies first (``roll_ds/distributed/shm.py``).
        Call it once the ranks have built what they hold (after ``initialize``). The ranks'
        child processes are recorded too (``replace_rank`` ends a dead rank's)."""
        record_shm(self.shm, [self])
        record_children(self)

    def shutdown(self, close_timeout_s: float = CLOSE_TIMEOUT_S) -> dict[str, int]:
        """End the role without leaving anything behind (placement groups stay with the
        ResourceManager): ``close`` every idle rank (bounded by ``close_timeout_s``; 0: skip,
        the caller closed them; a busy rank would answer only after its call), kill them all,
        wait until their processes, the ones they started and (on GPUs) their memory are gone
        (``retire_ranks``), then unlink the ``/dev/shm`` files they held that are still there
        (a rank that died, was busy, or did not close in time); returns those
        ``{name: bytes}``."""
        if self.actors and ray.is_initialized():
            self.record_shm()
            if close_timeout_s > 0:
                close_clusters([self], close_timeout_s)
        for actor in self.actors:
            with contextlib.suppress(Exception):  # best effort: Ray may already be gone
                ray.kill(actor, no_restart=True)
        if self.actors and ray.is_initialized():
            # a run restarting after a trainer died starts new ranks on these GPUs next
            retire_ranks([(info, self.children.pop(r, {})) for r, info in enumerate(self.infos)])
        self.actors = []
        if self.shm.files and ray.is_initialized():
            return sweep_shm(self.shm)
        return {}

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        nodes = sorted({i.get("node_ip", "?") for i in self.infos})
        cls = self.worker_cls.__name__
        return f"Cluster({self.name!r}, {cls}, world_size={self.world_size}, nodes={nodes})"


class PendingCall:
    """A submitted call; ``get()`` waits (bounded by the cluster's ``call_timeout_s``)."""

    def __init__(
        self,
        cluster: Cluster,
        method: str,
        spec: DispatchSpec,
        calls: list[tuple[int, tuple, dict[str, Any]]],
        refs: list,
        *,
        before_resend: Callable[[int], None] | None = None,
    ) -> None:
        self.cluster, self.method, self.spec, self.refs = cluster, method, spec, refs
        self.calls = calls  # (rank, args, kwargs): what a replaced rank is sent again
        self.ranks = [r for r, _, _ in calls]
        self.sent = time.monotonic()
        # what a replaced rank needs before its share is sent again (a streamed call: its
        # requests, which lived in the dead engine)
        self.before_resend = before_resend
        # rank -> the cluster's incarnation of it when the call was sent (None: unknown)
        self.incarnations: dict[int, int] | None = None

    def get(self, timeout_s: float | None = None, *, recover: bool = True) -> Any:
        """The combined results. With the cluster's ``recovery`` (and ``recover``), a rank
        that died or passed ``timeout_s`` is replaced and its share sent again, each try under
        the same bound, until the role's ``max_restarts`` are spent."""
        timeout_s = self.cluster.call_timeout_s if timeout_s is None else timeout_s
        recovery = self.cluster.recovery if recover else None
        try:
            while True:
                try:
                    results = self.cluster._gather(self.method, self.ranks, self.refs, timeout_s)
                    break
                except (WorkerError, WorkerTimeoutError) as exc:
                    if recovery is None or not recovery.handles(self.cluster, exc):
                        raise
                    replaced = recovery.replace(self.cluster, exc, self.sent, self.incarnations)
                    for rank in replaced:
                        if self.incarnations is not None:  # a second death is a new one
                            self.incarnations[rank] = self.cluster.incarnations[rank]
                        if self.before_resend is not None:
                            self.before_resend(rank)
                        for i, call in enumerate(self.calls):
                            if call[0] == rank:
                                self.refs[i] = self.cluster._resend(self.method, call)
        finally:
            # Drop the finished calls now: a held ref would keep its result in the object store.
            self.cluster._in_flight = self.cluster._unfinished()
        return collect(self.spec, results)


def _role_placements(
    name: str,
    resource_manager: ResourceManager | None,
    placements: Sequence[ActorPlacement] | None,
) -> list[ActorPlacement]:
    """The explicit ``placements``, else the resource manager's for ``name``; never empty."""
    if placements is None:
        if resource_manager is None:
            raise ValueError("Cluster needs a resource_manager or explicit placements")
        placements = resource_manager.placements(name)
    if not placements:
        raise ValueError(f"{name}: no placements (world_size 0)")
    return list(placements)


def _resolve(worker_cls: type[Worker] | ActorClass) -> tuple[type, ActorClass]:
    """(the user's class, the Ray actor class that sets the rank env before its __init__).

    An ``@ray.remote`` class is unwrapped: its decorator options are not kept (placement sets the
    resources; pass anything else through ``actor_options``).
    """
    cls = worker_cls
    if isinstance(worker_cls, ActorClass):
        modified = worker_cls.__ray_metadata__.modified_class  # Ray's subclass of the original
        cls = modified.__bases__[0] if "__ray_terminate__" in vars(modified) else modified
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"{cls!r} is not a subclass of roll_ds.distributed.worker.Worker")
    groups = getattr(cls, "CONCURRENCY_GROUPS", None)  # methods Ray threads beside the rest
    remote = ray.remote(concurrency_groups=groups) if groups else ray.remote
    return cls, remote(_with_rank_env(cls))


def _with_rank_env(cls: type) -> type:
    """Subclass of ``cls`` whose __init__ first applies the env Cluster passes as keywords: the
    rank's variables, then the platform's defaults where the process has no value yet (the
    role's ``system_envs``, set by Ray's runtime_env before the process started, win)."""

    def __init__(
        self,
        *args: Any,
        _roll_ds_env: Mapping[str, str],
        _roll_ds_env_defaults: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        # start-up profile (roll_ds/timeline.py): from the process's creation to here is
        # Python, Ray's worker boot and the worker module's imports
        timeline.record("boot", timeline.process_started(), time.time())
        os.environ.update(_roll_ds_env)
        for key, value in (_roll_ds_env_defaults or {}).items():
            os.environ.setdefault(key, value)
        with timeline.phase("__init__"):
            cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def _rank_env(base: Mapping[str, str], p: ActorPlacement) -> dict[str, str]:
    slot = p.slot
    env = dict(base)
    env.update(
        RANK=str(slot.rank), LOCAL_RANK="0", ROLL_DS_NODE_LOCAL_RANK=str(slot.node_local_rank)
    )
    if slot.node is not None:
        env["ROLL_DS_NODE"] = str(slot.node)
    env.update(p.env)  # e.g. CUDA_VISIBLE_DEVICES of a multi-device worker
    return env


def _thread_env(
    num_threads: int | None, first: ActorPlacement, device_resource: str | None
) -> dict[str, str]:
    if num_threads is None:
        on_cpu = first.node_id is None or device_resource in (None, "CPU")
        num_threads = 1 if on_cpu else max(1, int(first.options.get("num_cpus", 1)))
    n = str(num_threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "ROLL_DS_NUM_THREADS": n}
