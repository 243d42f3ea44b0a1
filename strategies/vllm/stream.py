"""Streaming generation: requests of several batches in one vLLM engine, stepped by a thread of
their own, that a weight sync pauses between decode steps.

``vllm.LLM.generate`` adds a batch and steps the engine until that batch is done, so a weight
sync sent to the rollout actor meanwhile waits for the whole batch (and for every batch queued
before it). ``RequestStream`` instead keeps one thread stepping the engine (``LLMEngine.step``)
while any request is unfinished; batches are added with ``submit`` (returns at once) and
collected with ``wait`` when the caller needs them. A weight sync runs between ``pause`` and
``resume``:

- ``pause`` waits for the step in progress to end and stops stepping (a multiprocess engine
  core, which steps on its own, is paused with vLLM's ``pause_scheduler(mode="keep")``: its
  requests stay queued);
- the caller loads the new weights and drops the KV cache of the running requests
  (``reset_prefix_cache(reset_running_requests=True)``): vLLM preempts them, and after
  ``resume`` recomputes each one's prompt and generated prefix with the new weights before it
  samples the next token;
- ``resume(version)`` labels what follows with the new policy version
  (``set_weight_version``), so every finished sample carries vLLM's per-token
  ``weight_versions`` spans: which policy version sampled each token.

Every call into the engine from another thread goes through ``engine_call`` (between steps);
the engine itself is not thread-safe.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Batch:
    """One submitted batch: its request ids in order and the finished outputs by id."""

    request_ids: list[str]
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.outputs) == len(self.request_ids)


class RequestStream:
    """The engine of ``llm`` (a ``vllm.LLM``) stepped by a background thread; see the module
    docstring."""

    def __init__(self, llm: Any) -> None:
        from vllm.v1.engine.core_client import InprocClient

        self._llm = llm
        self._engine = llm.llm_engine
        # An in-process engine core steps only when this thread calls step(); one in a process
        # of its own steps by itself and is paused through vLLM's scheduler.
        self._in_process = isinstance(self._engine.engine_core, InprocClient)
        self._cond = threading.Condition()
        self._busy = False  # a step or an engine call is in progress
        self._callers = 0  # threads waiting for engine_call: they go before the next step
        self._paused = False
        self._closed = False
        self._error: BaseException | None = None
        self._batches: dict[str, _Batch] = {}
        self._owner: dict[str, str] = {}  # request id -> batch tag
        self._unfinished = 0
        self._next_id = 0
        self.steps = 0  # engine steps taken (tests wait for progress with it)
        self.version: int | None = None  # the label of the weights now served
        self._thread = threading.Thread(target=self._loop, name="roll_ds-vllm-stream", daemon=True)
        self._thread.start()

    # --- the stepping thread -----------------------------------------------------------------

    def _can_step(self) -> bool:
        return not (self._busy or self._callers or self._paused) and self._unfinished > 0

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._can_step())
                if self._closed:
                    return
                self._busy = True
            try:
                outputs = self._engine.step()
            except BaseException as exc:  # the engine is unusable: every waiter gets the error
                with self._cond:
                    self._error = exc
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self.steps += 1
                for out in outputs:
                    if out.finished and out.request_id in self._owner:
                        tag = self._owner.pop(out.request_id)
                        self._batches[tag].outputs[out.request_id] = out
                        self._unfinished -= 1
                if self._unfinished and not outputs and not self._engine.has_unfinished_requests():
                    lost = sorted(self._owner)[:4]
                    self._error = RuntimeError(f"vLLM finished without returning {lost} ...")
                self._cond.notify_all()
                if self._error is not None:
                    return

    # --- calls from other threads --------------------------------------------------------------

    @contextlib.contextmanager
    def engine_call(self) -> Iterator[Any]:
        """Exclusive use of the engine (``vllm.LLM``) between two steps."""
        with self._cond:
            self._raise_if_failed()
            self._callers += 1
            try:
                self._cond.wait_for(lambda: not self._busy or self._error is not None)
            finally:
                self._callers -= 1
            self._raise_if_failed()
            self._busy = True
        try:
            yield self._llm
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def submit(
        self, tag: str, prompts: Sequence[dict], params: Sequence[Any], lora_request: Any = None
    ) -> None:
        """Add one request per prompt (``params[i]`` for ``prompts[i]``) as batch ``tag``."""
        if tag in self._batches:
            raise ValueError(f"generation batch {tag!r} was submitted already")
        from vllm.sampling_params import RequestOutputKind

        ids = []
        with self.engine_call():
            for prompt, p in zip(prompts, params, strict=True):
                p.output_kind = RequestOutputKind.FINAL_ONLY  # whole samples, when finished
                self._next_id += 1
                request_id = f"stream-{self._next_id}"  # outputs carry this id (vLLM's own
                self._engine.add_request(request_id, prompt, p, lora_request=lora_request)
                ids.append(request_id)  # internal one, returned here, adds a random suffix)
            with self._cond:
                self._batches[tag] = _Batch(ids)
                self._owner.update({rid: tag for rid in ids})
                self._unfinished += len(ids)

    def done(self, tag: str) -> bool:
        with self._cond:
            self._raise_if_failed()
            return self._batch(tag).done

    def wait(
        self, tag: str, timeout_s: float | None = None, *, through_pause: bool = False
    ) -> list[Any]:
        """Batch ``tag``'s ``RequestOutput``s in prompt order, once all are finished; the batch
        is forgotten. Raises ``TimeoutError`` after ``timeout_s`` (None: no limit).
        ``through_pause``: a caller that does not hold up the resume (another thread than the
        sync's) waits across a pause; any other wait on a paused stream would never end and
        raises instead."""
        with self._cond:
            batch = self._batch(tag)
            if self._paused and not batch.done and not through_pause:
                raise RuntimeError(
                    f"generation batch {tag!r} cannot finish while generation is paused; "
                    "resume_generation first"
                )
            ok = self._cond.wait_for(lambda: batch.done or self._error is not None, timeout_s)
            self._raise_if_failed()
            if not ok:
                raise TimeoutError(
                    f"generation batch {tag!r}: {len(batch.outputs)} of "
                    f"{len(batch.request_ids)} requests finished after {timeout_s} s"
                )
            del self._batches[tag]
            return [batch.outputs[rid] for rid in batch.request_ids]

    def wait_for_steps(self, count: int, timeout_s: float = 60.0) -> None:
        """Block until the engine has taken ``count`` steps in all (for tests)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.steps < count:
                self._raise_if_failed()
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"the engine took {self.steps} of {count} steps")

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def unfinished(self) -> int:
        with self._cond:
            return self._unfinished

    def pause(self) -> None:
        """Stop stepping after the step in progress (idempotent); see the module docstring."""
        with self._cond:
            if self._paused:
                return
            self._paused = True
            self._cond.wait_for(lambda: not self._busy or self._error is not None)
        if not self._in_process:
            with self.engine_call():
                self._engine.engine_core.call_utility("pause_scheduler", "keep", False)

    def resume(self, version: int) -> None:
        """Label the served weights ``version`` and step again."""
        with self.engine_call():
            self._engine.engine_core.set_weight_version(str(version))
            if not self._in_process and self._paused:
                self._engine.engine_core.call_utility("resume_scheduler")
        with self._cond:
            self.version = version
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _batch(self, tag: str) -> _Batch:
        if tag not in self._batches:
            raise KeyError(f"no generation batch {tag!r} in flight (have {sorted(self._batches)})")
        return self._batches[tag]

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"the vLLM engine failed while streaming: {self._error!r}"
            ) from self._error
