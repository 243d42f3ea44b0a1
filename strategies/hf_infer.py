"""``hf_infer``: a plain transformers model on one device, for reference log-probs (and HF
``generate`` where a small rollout or judge model does not need vLLM), or, with a ``head``, a
reward model scoring whole sequences (``score_sequences``).

As a rollout engine colocated with trainers it sleeps like the vllm strategy
(``roll_ds/pipeline/colocation/choreography.py``): ``offload_states(level)`` moves the model
to host memory and hands PyTorch's cached blocks back to the device, ``reload_states(tags)``
brings back the ``weights`` and / or the ``kv_cache``. HF ``generate`` allocates its KV cache
per call and frees it after, so the ``kv_cache`` tag holds nothing: only the state is tracked.
While a tag is asleep the calls that need it refuse, on CPU too (where nothing moves), so a
wrong order shows in CPU tests. As the reference role it is offloaded and reloaded whole (no
arguments)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from roll_ds.config.schema import GeneratingArgs, ModelArgs, WorkerConfig
from roll_ds.models.loading import load_causal_lm, resolve_model_path
from roll_ds.models.reward_model import check_head, forward_scores, load_reward_model
from roll_ds.strategy import StrategyContext
from strategies import _common
from strategies.micro_batches import token_batched_forward

WEIGHTS, KV_CACHE = "weights", "kv_cache"
SLEEP_TAGS = (WEIGHTS, KV_CACHE)  # what offload_states releases, as vLLM's sleep names them
SLEEP_LEVELS = (1, 2)

RESULT_KEYS = (
    "prompt_index",
    "sample_index",
    "response_ids",
    "logprobs",
    "finish_reason",
    "stop_reason",
)


class HfInferStrategy:
    def __init__(
        self,
        *,
        model_path: str,
        model_args: ModelArgs | None = None,
        generating_args: GeneratingArgs | None = None,
        infer_batch_size: int = 8,
        seed: int = 42,
        max_new_tokens: int = 32,
        stop_token_ids: Sequence[int] = (),
        logprob_temperature: float = 1.0,
        head: str | None = None,
        max_tokens_per_micro_batch: int | None = None,
        use_sequence_packing: bool = False,
    ) -> None:
        # None: a causal LM; a reward-model head (roll_ds.models.reward_model.HEADS): a scorer.
        self.head = None if head is None else check_head(head)
        self.logprob_temperature = _common.check_temperature(logprob_temperature)
        self.model_path = model_path
        self.model_args = model_args or ModelArgs()
        self.generating_args = generating_args or GeneratingArgs()
        self.infer_batch_size = infer_batch_size
        # log-probs by token budget, packed (strategies/micro_batches.py); scores by rows
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.use_sequence_packing = use_sequence_packing
        self.seed = seed
        self.max_new_tokens = self.generating_args.max_new_tokens or max_new_tokens
        self.stop_token_ids = list(stop_token_ids)
        self.model: Any = None
        self._asleep: set[str] = set()  # SLEEP_TAGS released by offload_states

    @classmethod
    def from_worker_config(
        cls, worker: WorkerConfig, ctx: StrategyContext, head: str | None = None
    ) -> HfInferStrategy:
        return cls(
            head=head,
            model_path=worker.model_args.model_name_or_path or ctx.pretrain,
            model_args=worker.model_args,
            generating_args=worker.generating_args,
            infer_batch_size=worker.infer_batch_size,
            seed=ctx.seed,
            max_new_tokens=ctx.response_length,
            stop_token_ids=ctx.stop_token_ids,
            logprob_temperature=ctx.logprob_temperature,
            max_tokens_per_micro_batch=worker.max_tokens_per_micro_batch,
            use_sequence_packing=worker.use_sequence_packing,
        )

    def initialize(self) -> None:
        self.device = _common.device()
        self.model_path = resolve_model_path(self.model_path)
        load = load_causal_lm if self.head is None else partial(load_reward_model, head=self.head)
        self.model = load(
            self.model_path,
            dtype=self.model_args.dtype,
            attn_impl=self.model_args.attn_implementation,
        ).to(self.device)
        self.model.eval()

    @torch.no_grad()
    def compute_logprobs(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        *,
        with_entropy: bool = False,
        temperature: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probs of ``input_ids[:, 1:]`` (``[B, T-1]``, fp32 on CPU) at ``temperature``
        (None: the rollouts' ``logprob_temperature``), ``infer_batch_size`` rows per forward."""
        self._require_awake(WEIGHTS)
        temperature = self.logprob_temperature if temperature is None else temperature
        if self.max_tokens_per_micro_batch is not None:
            return token_batched_forward(
                lambda ids, mask: _common.forward_logprobs(
                    self.model,
                    ids,
                    mask,
                    with_entropy=with_entropy,
                    temperature=temperature,
                    packed=self.use_sequence_packing,
                ),
                input_ids_BT,
                attention_mask_BT,
                max_tokens=self.max_tokens_per_micro_batch,
                packed=self.use_sequence_packing,
                device=self.device,
                lockstep=False,
                empty_keys=("logprobs_BT", "entropy_BT") if with_entropy else ("logprobs_BT",),
            )
        parts: dict[str, list[torch.Tensor]] = {}
        for start, stop in _common.iter_chunks(input_ids_BT.shape[0], self.infer_batch_size):
            out = _common.forward_logprobs(
                self.model,
                input_ids_BT[start:stop].to(self.device),
                attention_mask_BT[start:stop].to(self.device),
                with_entropy=with_entropy,
                temperature=temperature,
                packed=self.use_sequence_packing,
            )
            for k, v in out.items():
                parts.setdefault(k, []).append(v.float().cpu())
        return {k: torch.cat(v) for k, v in parts.items()}

    @torch.no_grad()
    def score_sequences(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``scores_B`` (fp32 on CPU): the reward head at each left-padded row's last token,
        ``infer_batch_size`` rows per forward (a strategy built with a ``head`` only)."""
        if self.head is None:
            raise RuntimeError("score_sequences needs a strategy built with a reward-model head")
        self._require_awake(WEIGHTS)
        parts = [
            forward_scores(
                self.model,
                self.head,
                input_ids_BT[start:stop].to(self.device),
                attention_mask_BT[start:stop].to(self.device),
            ).cpu()
            for start, stop in _common.iter_chunks(input_ids_BT.shape[0], self.infer_batch_size)
        ]
        return {"scores_B": torch.cat(parts) if parts else torch.zeros(0)}

    @torch.no_grad()
    def generate(
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
        first_prompt_index: int = 0,
        prompt_indices: Sequence[int] | None = None,
        max_new_tokens_each: Sequence[int] | None = None,
    ) -> dict[str, list[Any]]:
        """Sample ``n`` responses per prompt with HF ``generate`` (unset arguments come from
        ``generating_args``). Same result shape as the vllm strategy: flat per-sample lists,
        sample ``j`` of prompt ``i`` at row ``i * n + j``: ``prompt_index``, ``sample_index``,
        ``response_ids`` (a stop token included), ``logprobs`` (the sampled tokens' log-probs
        under the distribution they were drawn from: after temperature and top-k/top-p, like
        the vllm strategy's),
        ``finish_reason`` (``"stop"`` or ``"length"``), ``stop_reason`` (None).

        HF ``generate`` draws every row of the batch from one generator (seeded with ``seed``
        and the first prompt's index, ``prompt_indices[0]`` or ``first_prompt_index``): unlike
        vllm's per-request seeds, what a prompt samples depends on the batch it is in.
        ``max_new_tokens_each``: a token limit per prompt (the batch generates to the largest,
        each row is cut to its own)."""
        self._require_awake(*SLEEP_TAGS)
        g = self.generating_args
        n = n if n is not None else g.num_return_sequences
        temperature = g.temperature if temperature is None else temperature
        top_p = g.top_p if top_p is None else top_p
        top_k = g.top_k if top_k is None else top_k
        seed = g.seed if seed is None else seed
        max_new = max_new_tokens or self.max_new_tokens
        limits = [int(m) for m in max_new_tokens_each or [max_new] * len(prompts)]
        max_new = max(limits)
        if prompt_indices is not None:
            first_prompt_index = int(prompt_indices[0])
        cfg = self.model.generation_config
        stops = set(_as_list(cfg.eos_token_id)) | set(stop_token_ids or self.stop_token_ids)
        pad_id = _first(cfg.pad_token_id, cfg.eos_token_id, 0)
        ids_BT, mask_BT = _left_pad(prompts, pad_id)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new,
            do_sample=temperature > 0,
            num_return_sequences=n,
            pad_token_id=pad_id,
            eos_token_id=sorted(stops) or None,
            return_dict_in_generate=True,
            output_scores=True,  # the logits after temperature and top-k/top-p
        )
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed + first_prompt_index)
            out = self.model.generate(
                input_ids=ids_BT.to(self.device), attention_mask=mask_BT.to(self.device), **kwargs
            )
        new_BT = out.sequences[:, ids_BT.shape[1] :].cpu()
        logits_BTV = torch.stack(out.scores, dim=1).float().cpu()
        logprobs_BT = _common.logprobs_from_logits(logits_BTV, new_BT)
        result: dict[str, list[Any]] = {k: [] for k in RESULT_KEYS}
        for row, (ids, lps) in enumerate(zip(new_BT.tolist(), logprobs_BT.tolist(), strict=True)):
            ids, lps = ids[: limits[row // n]], lps[: limits[row // n]]
            stop_at = next((t for t, tok in enumerate(ids) if tok in stops), None)
            length = len(ids) if stop_at is None else stop_at + 1
            result["prompt_index"].append(row // n)
            result["sample_index"].append(row % n)
            result["response_ids"].append(ids[:length])
            result["logprobs"].append(lps[:length])
            result["finish_reason"].append("length" if stop_at is None else "stop")
            result["stop_reason"].append(None)
        return result

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (names it lacks are an error)."""
        self._require_awake(WEIGHTS)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"load_weights: model has no parameter {name!r}")
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    # -----------------------------------------------------------------------------------------
    # colocation

    def offload_states(self, level: int = 1) -> None:
        """Sleep: the model to host memory and PyTorch's cached blocks (what ``generate``'s KV
        cache and activations left) back to the device. ``level`` 2 lets an engine drop
        weights the next sync refills; an HF module cannot be emptied and refilled in place, so
        both levels keep them in host memory. On CPU nothing moves; the state is tracked."""
        self._require_initialized()
        if level not in SLEEP_LEVELS:
            raise ValueError(f"offload_states: level must be one of {SLEEP_LEVELS}, got {level}")
        if WEIGHTS not in self._asleep and self.device.type != "cpu":
            self.model.to("cpu")
        self._asleep = set(SLEEP_TAGS)
        _release_cached_memory(self.device)

    def reload_states(self, tags: Iterable[str] | None = None) -> None:
        """Undo ``offload_states`` for ``tags`` (None: all). ``["weights"]`` first lets a weight
        sync run before generation wakes the rest, as with the vllm strategy."""
        self._require_initialized()
        wanted = set(SLEEP_TAGS if tags is None else tags)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"reload_states: unknown tags {sorted(unknown)}; valid: {SLEEP_TAGS}")
        if WEIGHTS in wanted & self._asleep and self.device.type != "cpu":
            self.model.to(self.device)
        self._asleep -= wanted

    def _require_initialized(self) -> None:
        if self.model is None:
            raise RuntimeError("HfInferStrategy.initialize() has not been called")

    def _require_awake(self, *tags: str) -> None:
        self._require_initialized()
        asleep = self._asleep & set(tags)
        if asleep:
            raise RuntimeError(
                f"the hf_infer model's {', '.join(sorted(asleep))} are offloaded; call "
                "reload_states() first"
            )


def _release_cached_memory(device: torch.device) -> None:
    """Hand the blocks PyTorch's caching allocator keeps back to the GPU (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _first(*values: Any) -> int:
    for v in values:
        if v is not None:
            return _as_list(v)[0]
    return 0
