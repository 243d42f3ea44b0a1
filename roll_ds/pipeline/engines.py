"""The rollout engines (``actor_infer``) as the pipeline calls them: one typed handle.

``generate`` takes one turn's requests (``roll_ds.agentic.runner.TurnRequest``: token ids in, ``n``
samples out) and returns each request's samples. Requests that share ``n`` and seed go in one call
to every engine (a step of dataset rows is one call, as is every turn of environment episodes);
a mixed turn makes one call of each kind. Each call waits at most ``bounds`` for the tokens it
may read and produce (``fault_tolerance``); past it the engine is stuck (``WorkerTimeoutError``).
Two ways to run a call:

- batch: ``RolloutWorker.generate``, one blocking call per engine (a weight sync sent meanwhile
  runs after it);
- stream (``async_generation.mode: stream``): ``submit_stream`` adds the requests to the
  engine's request stream and returns; ``collect_stream`` waits for them in the worker's
  ``stream_wait`` concurrency group, so a weight sync's pause, reload and resume run meanwhile
  and the requests go on with the new weights between two decode steps.

An engine that dies is replaced inside the call (``fault_tolerance``, ``pipeline/faults.py``):
its share of a batch call is sent again; a streamed batch's share is submitted again to the
new engine first (the requests lived in the dead one's process).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from roll_ds.agentic.runner import Sample, TurnRequest
from roll_ds.distributed.batch import Batch
from roll_ds.distributed.recovery import CallBounds
from roll_ds.pipeline.workers import PROBE_META


class RolloutEngines:
    """Typed calls on the ``actor_infer`` cluster."""

    def __init__(self, cluster: Any, bounds: CallBounds | None = None) -> None:
        self.cluster = cluster
        self.bounds = bounds  # None: the cluster's call_timeout_s for every call
        self._tags = itertools.count()

    @property
    def name(self) -> str:
        return self.cluster.name

    def generate(
        self,
        requests: list[TurnRequest],
        sampling: Mapping[str, Any],
        *,
        stream: bool = False,
        probe: dict | None = None,
    ) -> tuple[list[list[Sample]], list[Any]]:
        """Each request's ``n`` samples, and (``probe``: parity-probe rows every engine scores
        in the same engine steps) the probe's log-probs per engine rank."""
        calls: dict[tuple[int, int], list[int]] = {}
        for i, request in enumerate(requests):
            calls.setdefault((request.n, request.seed), []).append(i)
        pending = []
        for k, ((n, seed), positions) in enumerate(calls.items()):
            batch = Batch(
                non_tensors={
                    "prompt_ids": [requests[i].context for i in positions],
                    "row": [requests[i].index for i in positions],
                    "max_new_tokens": [requests[i].max_new_tokens for i in positions],
                }
            )
            if stream:
                tag = f"turn-{next(self._tags)}"
                call = self._stream(batch, dict(tag=tag, seed=seed, n=n, **sampling))
            else:
                extra = {"probe": probe} if probe is not None and k == 0 else {}
                call = self.cluster.submit("generate", batch, seed=seed, n=n, **extra, **sampling)
            # what the call may read and write: its bound grows with it
            tokens = n * sum(
                len(requests[i].context) + requests[i].max_new_tokens for i in positions
            )
            pending.append((positions, call, tokens))
        samples: list[list[Sample]] = [[] for _ in requests]
        probe_logprobs: list[Any] = []
        for positions, call, tokens in pending:
            out = call.get(None if self.bounds is None else self.bounds.tokens(tokens))
            if isinstance(out, list):  # collect_stream: every rank's share, in rank order
                out = Batch.concat(out)
            at = {requests[i].index: i for i in positions}
            versions = out.non_tensors.get("token_versions")
            for j, row in enumerate(out["row"]):
                samples[at[int(row)]].append(
                    Sample(
                        list(out["response_ids"][j]),
                        list(out["rollout_logprobs"][j]),
                        str(out["finish_reason"][j]),
                        None if versions is None else list(versions[j]),
                    )
                )
            ranks = sorted(int(k.split("/")[1]) for k in out.meta if k.startswith(PROBE_META))
            probe_logprobs += [out.meta[f"{PROBE_META}{r}"] for r in ranks]
        return samples, probe_logprobs

    def _stream(self, batch: Batch, submit: dict[str, Any]) -> Any:
        """Submit ``batch`` to the engines' request streams (``submit``: the tag, seed and
        sampling); returns the call that collects it. An engine replaced meanwhile (dead:
        ``fault_tolerance``) lost its requests with its process: its share of ``batch`` is
        submitted to the new one before the collect is sent to it again."""
        self.cluster.call("submit_stream", batch, **submit)

        def submit_again(rank: int) -> None:
            bound = None if self.bounds is None else self.bounds.base_s
            self.cluster.submit("submit_stream", batch, _ranks=[rank], **submit).get(bound)

        return self.cluster.submit("collect_stream", submit["tag"], _before_resend=submit_again)

    def pause(self) -> None:
        """Stop the engines' request streams between two decode steps (before a sync)."""
        self.cluster.call("pause_generation")

    def resume(self, version: int) -> None:
        """Generate on; tokens from now on are labelled policy ``version``."""
        self.cluster.call("resume_generation", version)

    def probe_logprobs(self, probe: Mapping[str, Any]) -> list[Any]:
        """Every engine's log-probs of the whole parity probe (one tensor per rank)."""
        return self.cluster.submit("probe_logprobs", Batch(dict(probe))).get()
