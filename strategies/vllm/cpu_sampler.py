"""vLLM's sampler on CPU without its one compiled kernel on roll_ds's path.

vLLM counts each sampled (and each prompt) token's rank in the vocabulary with
``vllm.v1.sample.ops.logprobs.batched_count_greater_than``, decorated with ``torch.compile``
(inductor) so that on GPUs the count makes no vocabulary-sized copies. On CPU that compile is
paid by every engine on its first request that asks for log-probs, which every roll_ds request
does: dynamo and inductor traced it for 3.5 s of a 3.6 s first parity probe on the 2-core box
(0.015 s the second time), with ``enforce_eager`` or not, on every run's first rollout or
evaluation. The count is exact either way, so on CPU the sampler gets the same expression
run eagerly; GPUs keep vLLM's compiled one.

``eager_token_ranks`` runs in each vLLM worker process (``RollDsWorkerExtension``, called
once the engine is up), before the first request.
"""

from __future__ import annotations

from typing import Any

SAMPLER_MODULE = "vllm.v1.sample.sampler"
COUNT_NAME = "batched_count_greater_than"


def count_at_least(x: Any, values: Any) -> Any:
    """Per row of ``x``, how many entries are >= that row's value (``values``: ``[B, 1]``):
    vLLM's compiled ``batched_count_greater_than``, eagerly."""
    return (x >= values).sum(-1)


def eager_token_ranks() -> bool:
    """Give this process's vLLM sampler ``count_at_least`` in place of the compiled count;
    False if this vLLM's sampler has no such function (nothing is changed)."""
    import importlib

    sampler = importlib.import_module(SAMPLER_MODULE)
    if not callable(getattr(sampler, COUNT_NAME, None)):
        return False
    setattr(sampler, COUNT_NAME, count_at_least)
    return True
