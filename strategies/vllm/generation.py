"""Requests through the engine: ``generate``, streaming generation (``submit`` / ``collect``
between ``pause_generation`` and ``resume_generation``) and prompt-token log-probs
(``compute_logprobs``). ``GenerationMixin`` holds these methods of ``VllmStrategy``
(``strategies/vllm/strategy.py``, which starts and stops the engine); the requests and outputs
themselves are built and parsed by ``strategies/vllm/requests.py``, the stream is
``strategies/vllm/stream.py``.

Prompts and responses are token ids (the engine is started with ``skip_tokenizer_init=True``
unless ``strategy_config`` says otherwise), so stop tokens are explicit: pass the tokenizer's
eos id(s) as ``stop_token_ids`` (eos ids declared in the model's ``generation_config.json`` are
honoured by vLLM on its own).

Log-probs. vLLM's ``logprobs_mode`` is ``processed_logprobs``: each sampled token's value is its
log-prob under the distribution it was actually drawn from, ``log_softmax(logits / T)`` after
top-k/top-p truncation. The trainer computes ``log_softmax(logits / T)`` for the same tokens
(``StrategyContext.logprob_temperature``), so the two agree whatever the temperature, and differ
only where top-k/top-p cut the distribution, which is what the train/inference mismatch metrics
and the truncated importance-sampling correction are for. At ``T = 1`` without truncation this
equals ``raw_logprobs``. Prompt-token log-probs (``compute_logprobs``, the weight-sync parity
probe) are always the raw model's, at temperature 1.

Seeds. With a seed, prompt ``i``'s request gets seed ``request_seed(seed, i)`` and vLLM gives its
``j``-th sample ``request_seed + j``: the samples are reproducible for a fixed seed, each
request's sampling noise is its own whatever else is in the batch, and different prompts get
different noise. The pipeline should
pass a new seed every step (for instance ``base_seed + step``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roll_ds.config.schema import GeneratingArgs
from roll_ds.weight_sync.adapter import AdapterVersions
from strategies.vllm.requests import (
    parse_request_outputs,
    request_seed,
    sampled_logprobs,
    sampling_kwargs,
    unpadded_rows,
)
from strategies.vllm.stream import RequestStream

if TYPE_CHECKING:
    import torch


class GenerationMixin:
    """``VllmStrategy``'s requests through the engine: one batch at a time (``generate``), or
    several in flight in the request stream (``submit`` / ``collect``), which a weight sync
    pauses between decode steps."""

    # VllmStrategy provides these (and _require_awake)
    llm: Any  # the vllm.LLM
    generating_args: GeneratingArgs
    stop_token_ids: list[int]
    _adapters: AdapterVersions | None
    _lora_request: Any
    _stream: RequestStream | None
    _stream_n: dict[str, int]
    _calls: int

    # -----------------------------------------------------------------------------------------
    # rollouts

    def _requests(
        self,
        prompts: list[list[int]],
        *,
        n: int | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        first_prompt_index: int = 0,
        prompt_indices: Sequence[int] | None = None,
        max_new_tokens_each: Sequence[int] | None = None,
    ) -> tuple[list[dict], list[Any], int]:
        """vLLM requests, sampling parameters and ``n`` for ``n`` samples of each prompt
        (token ids). Arguments left None come from ``generating_args`` (``seed`` too: None there
        means unseeded sampling); ``stop_token_ids`` default to the constructor's. Prompt ``i``
        is seeded as the batch's prompt ``first_prompt_index + i`` (or ``prompt_indices[i]``),
        so a batch split over several engines samples what one engine would.
        ``max_new_tokens_each``: a token limit per prompt (agentic turns near their context
        budget), instead of one for all."""
        from vllm import SamplingParams

        self._require_awake()
        g = self.generating_args
        n = g.num_return_sequences if n is None else n
        seed = g.seed if seed is None else seed
        base = sampling_kwargs(
            n=n,
            max_new_tokens=g.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=g.temperature if temperature is None else temperature,
            top_p=g.top_p if top_p is None else top_p,
            top_k=g.top_k if top_k is None else top_k,
            seed=None,
            stop_token_ids=self.stop_token_ids if stop_token_ids is None else stop_token_ids,
            ignore_eos=ignore_eos,
        )
        indices = (
            list(prompt_indices)
            if prompt_indices is not None
            else [first_prompt_index + i for i in range(len(prompts))]
        )
        limits = list(max_new_tokens_each or [base["max_tokens"]] * len(prompts))
        if len(indices) != len(prompts) or len(limits) != len(prompts):
            raise ValueError("prompt_indices / max_new_tokens_each need one entry per prompt")
        params = [
            SamplingParams(
                **{**base, "seed": request_seed(seed, index), "max_tokens": max(1, int(limit))}
            )
            for index, limit in zip(indices, limits, strict=True)
        ]
        requests = [{"prompt_token_ids": list(p)} for p in _check_prompts(prompts)]
        return requests, params, n

    def generate(
        self, prompts: list[list[int]], *, probe: dict | None = None, **kwargs: Any
    ) -> dict[str, list[Any]]:
        """``n`` samples for each prompt (token ids); see ``parse_request_outputs`` for the
        result and ``_requests`` for the arguments. With the request stream started
        (``submit``), the batch joins the requests in flight there. ``probe``
        (``input_ids`` / ``attention_mask``): its rows' prompt log-probs are scored in the
        same ``generate`` call (``probe_logprobs_BT``, as ``compute_logprobs`` gives them)."""
        requests, params, n = self._requests(prompts, **kwargs)
        if self._stream is not None:
            if probe is not None:
                raise ValueError("a parity probe rides on generate only without a request stream")
            return parse_request_outputs(self._stream_call(requests, params), n)
        scoring = None if probe is None else _PromptScoring.of(probe)
        if scoring is not None:  # the probe's prefills join the rollout's engine steps
            requests = requests + scoring.requests
            params = params + [scoring.params.clone() for _ in scoring.requests]
        outputs = self.llm.generate(
            requests, params, lora_request=self._lora_request, use_tqdm=False
        )
        if scoring is None:
            return parse_request_outputs(outputs, n)
        split = len(outputs) - len(scoring.requests)
        result = parse_request_outputs(outputs[:split], n)
        result["probe_logprobs_BT"] = scoring.logprobs_BT(outputs[split:])
        return result

    # -----------------------------------------------------------------------------------------
    # streaming generation (async_generation.mode: stream; strategies/vllm/stream.py)

    def submit(self, tag: str, prompts: list[list[int]], **kwargs: Any) -> None:
        """Start generating batch ``tag`` (``generate``'s arguments) and return at once; the
        request stream starts on the first call. ``collect(tag)`` waits for the samples."""
        requests, params, n = self._requests(prompts, **kwargs)
        self._start_stream().submit(tag, requests, params, self._lora_request)
        self._stream_n[tag] = n

    def collect(self, tag: str, timeout_s: float | None = None) -> dict[str, list[Any]]:
        """Batch ``tag``'s samples as ``generate`` returns them, plus ``token_versions``: the
        policy version that sampled each response token (``resume_generation``'s labels).
        Waits across a pause: the caller is a thread of its own (the rollout worker's
        ``stream_wait`` group), and the sync's resume comes on another."""
        if self._stream is None:
            raise RuntimeError(f"collect({tag!r}): nothing was submitted to the request stream")
        outputs = self._stream.wait(tag, timeout_s, through_pause=True)
        return parse_request_outputs(outputs, self._stream_n.pop(tag), with_versions=True)

    def pause_generation(self) -> None:
        """Stop the request stream between two decode steps (starting it if needed): the
        weight sync that follows may replace the weights under the requests in flight."""
        self._start_stream().pause()

    def resume_generation(self, version: int) -> None:
        """Generate on after a sync; tokens from now on are labelled policy ``version``."""
        self._start_stream().resume(version)

    def _start_stream(self) -> RequestStream:
        self._require_awake()
        if self._stream is None:
            if self._lora_request is not None or self._adapters is not None:
                raise RuntimeError(
                    "streaming generation swaps weights under requests in flight; adapter "
                    "syncs (weight_sync.lora_sync=adapter) retire the adapter those requests "
                    "use: use lora_sync=merged with async_generation.mode=stream"
                )
            self._stream = RequestStream(self.llm)
        return self._stream

    def _stream_call(self, requests: list[dict], params: list[Any]) -> list[Any]:
        """One batch through the request stream, waited for."""
        self._calls += 1
        tag = f"call-{self._calls}"
        self._stream.submit(tag, requests, params, self._lora_request)
        return self._stream.wait(tag)

    # -----------------------------------------------------------------------------------------
    # prompt log-probs (InferenceStrategy; the weight-sync parity probe scores with them)

    def compute_logprobs(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        *,
        with_entropy: bool = False,
        temperature: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probs of ``input_ids[:, 1:]`` (``[B, T-1]``, 0 at padding) from vLLM's prompt
        log-probs, one prefill per row: the raw model's, so ``temperature`` may only be 1 (or
        None). Entropy needs the full distribution per position, which vLLM only returns as a
        Python dict per token: not offered (use hf_infer)."""
        if with_entropy:
            raise NotImplementedError(
                "the vllm strategy does not compute entropy; use hf_infer or deepspeed_* for it"
            )
        if temperature not in (None, 1.0):
            raise NotImplementedError(
                f"the vllm strategy scores prompt tokens with the raw model (temperature 1), "
                f"not at temperature {temperature}; use hf_infer or deepspeed_* for that"
            )
        self._require_awake()
        scoring = _PromptScoring.of(
            {"input_ids": input_ids_BT, "attention_mask": attention_mask_BT}
        )
        if self._stream is not None:
            outputs = self._stream_call(
                scoring.requests, [scoring.params.clone() for _ in scoring.requests]
            )
        else:
            outputs = self.llm.generate(
                scoring.requests, scoring.params, lora_request=self._lora_request, use_tqdm=False
            )
        return {"logprobs_BT": scoring.logprobs_BT(outputs)}


@dataclass(frozen=True)
class _PromptScoring:
    """vLLM requests that score padded rows' prompt tokens (one prefill each, ``max_tokens=1``)
    and the ``[B, T-1]`` log-probs their outputs give (0 at padding and each row's first
    token)."""

    rows: list[list[int]]  # each row's real tokens
    scored: list[int]  # rows with >= 2 tokens: the ones requested
    attention_mask_BT: Any
    requests: list[dict]
    params: Any  # SamplingParams

    @classmethod
    def of(cls, batch: dict) -> _PromptScoring:
        from vllm import SamplingParams

        rows = unpadded_rows(batch["input_ids"], batch["attention_mask"])
        scored = [i for i, r in enumerate(rows) if len(r) >= 2]
        return cls(
            rows=rows,
            scored=scored,
            attention_mask_BT=batch["attention_mask"],
            requests=[{"prompt_token_ids": rows[i]} for i in scored],
            params=SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
        )

    def logprobs_BT(self, outputs: list[Any]) -> Any:
        import torch

        mask = self.attention_mask_BT
        logprobs_BT = torch.zeros(mask.shape[0], mask.shape[1] - 1)
        for b, out in zip(self.scored, outputs, strict=True):
            values = sampled_logprobs(self.rows[b][1:], out.prompt_logprobs[1:])  # [0] is None
            first = int(mask[b].nonzero()[0])
            logprobs_BT[b, first : first + len(values)] = torch.tensor(values)
        return logprobs_BT


def _check_prompts(prompts: list[list[int]]) -> list[list[int]]:
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:8]} are empty; every prompt needs at least one token")
    return prompts
