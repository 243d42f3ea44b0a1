"""Translation between roll_ds's token-id batches and vLLM's request / response objects: sampling
parameters, per-prompt seeds, parsing ``RequestOutput``s, un-padding probe rows. Pure (no vLLM
import), unit-tested with fakes shaped like vLLM's outputs; ``strategies/vllm/generation.py``
drives the engine with them. The seed scheme is described in that module's docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SEED_MASK = 2**31 - 1
_SEED_MIX = 0x9E3779B1  # odd 32-bit constant: prompt i's base seed lands far from prompt i+1's


def request_seed(seed: int | None, prompt_index: int) -> int | None:
    """Seed of prompt ``prompt_index``'s request (vLLM seeds its samples ``+0, +1, ...``)."""
    if seed is None:
        return None
    return (seed * _SEED_MIX + prompt_index * 0x632BE5AB + 0x5BD1E995) & SEED_MASK


def sampling_kwargs(
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one rollout request (raises on values
    vLLM would reject, naming the generating_args field)."""
    errors = []
    if n < 1:
        errors.append(f"num_return_sequences (n) must be >= 1, got {n}")
    if max_new_tokens < 1:
        errors.append(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        errors.append(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        errors.append(f"top_p must be in (0, 1], got {top_p}")
    if top_k < -1:
        errors.append(f"top_k must be -1 or 0 (off) or >= 1, got {top_k}")
    if errors:
        raise ValueError("invalid generating_args: " + "; ".join(errors))
    return {
        "n": n,
        "max_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop_token_ids": list(stop_token_ids),
        "ignore_eos": ignore_eos,
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
    }


def sampled_logprobs(token_ids: Sequence[int], position_logprobs: Sequence[Any]) -> list[float]:
    """The sampled token's log-prob at every position from vLLM's per-position
    ``{token_id: Logprob}`` mappings (``logprobs=0`` returns exactly the sampled token)."""
    if position_logprobs is None:
        raise ValueError("vLLM returned no log-probs; the request needs logprobs=0")
    if len(position_logprobs) != len(token_ids):
        raise ValueError(
            f"{len(position_logprobs)} log-prob positions for {len(token_ids)} sampled tokens"
        )
    return [float(pos[tok].logprob) for tok, pos in zip(token_ids, position_logprobs, strict=True)]


def token_versions(spans: Sequence[Any] | None, num_tokens: int) -> list[int]:
    """The policy version of each of a sample's ``num_tokens`` tokens from vLLM's
    ``weight_versions`` spans (``version`` label, ``[start, end)``); -1 where no span or an
    unnumbered label (vLLM's ``"default"``, before the first labelled sync) covers a token."""
    versions = [-1] * num_tokens
    for span in spans or ():
        label = str(span.version)
        if label.lstrip("-").isdigit():
            versions[span.start : span.end] = [int(label)] * (span.end - span.start)
    return versions[:num_tokens]


def parse_request_outputs(
    outputs: Sequence[Any], n: int, *, with_versions: bool = False
) -> dict[str, list[Any]]:
    """vLLM ``RequestOutput``s (one per prompt, in prompt order) as flat per-sample lists, prompt
    major: sample ``j`` of prompt ``i`` is row ``i * n + j``.

    Keys: ``prompt_index``, ``sample_index``, ``response_ids`` (generated ids, a stop token
    included), ``logprobs`` (the sampled tokens' raw log-probs, same length),
    ``finish_reason`` (``"stop"``: eos or a stop token, ``"length"``: hit max_new_tokens),
    ``stop_reason`` (the stop token id that ended the sample, None for eos / length) and,
    ``with_versions``, ``token_versions`` (``token_versions``: who sampled each token).
    """
    result: dict[str, list[Any]] = {
        "prompt_index": [],
        "sample_index": [],
        "response_ids": [],
        "logprobs": [],
        "finish_reason": [],
        "stop_reason": [],
    }
    if with_versions:
        result["token_versions"] = []
    for prompt_index, request in enumerate(outputs):
        samples = sorted(request.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise ValueError(f"prompt {prompt_index}: {len(samples)} samples, expected n={n}")
        for sample in samples:
            ids = list(sample.token_ids)
            result["prompt_index"].append(prompt_index)
            result["sample_index"].append(sample.index)
            result["response_ids"].append(ids)
            result["logprobs"].append(sampled_logprobs(ids, sample.logprobs))
            result["finish_reason"].append(sample.finish_reason)
            result["stop_reason"].append(sample.stop_reason)
            if with_versions:
                spans = getattr(sample, "weight_versions", None)
                result["token_versions"].append(token_versions(spans, len(ids)))
    return result


def unpadded_rows(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens; padding may be on either side but not inside a row."""
    rows = []
    for b in range(input_ids_BT.shape[0]):
        idx = attention_mask_BT[b].nonzero().flatten()
        if len(idx) and int(idx[-1] - idx[0]) + 1 != len(idx):
            raise ValueError(f"row {b}: attention mask has holes; only edge padding is supported")
        rows.append(input_ids_BT[b, idx].tolist())
    return rows
