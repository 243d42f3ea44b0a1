"""Time GRPO steps of TRL's ``GRPOTrainer`` on the settings of benchmarks/rlvr_step.py.

    pip install trl==1.16.0                                    # not a core dependency
    PYTHONPATH=. python benchmarks/trl_grpo_step.py            # embedded default + the ~20M model
    PYTHONPATH=. python benchmarks/trl_grpo_step.py --models embedded --steps 3 --out /tmp/trl.json

Every setting comes from the config rlvr_step.py composes (examples/qwen_rlvr/rlvr_lora_zero3.yaml
plus the same per-model overrides), so the two benchmarks stay equal when the YAML changes: the
model and tokenizer, prompts per step (16) and group size (8), response length
(``max_completion_length``), LoRA (r16, alpha 32, all-linear, no dropout), AdamW lr 2e-3 with
2 warm-up steps then constant, no weight decay, grad-norm clip 1.0, temperature 1.0, top-p 1.0,
PPO clip 0.2 / 0.28, token-mean loss (TRL ``loss_type="dapo"``), group-std advantages, no KL
term (``beta=0``: no reference forward in either), no gradient checkpointing, fp32 (``--dtype
bf16``: both load the model in bf16; ours trains it with DeepSpeed's bf16 mode, fp32 master
weights in the optimizer, where peft keeps TRL's adapter in fp32). The prompts
are the very ones our pipeline draws (``PromptSampler``, same seed, same order; the JSON's
``same_prompts`` checks it) and the reward is the same rule for both domains:
``roll_ds.data.dataset.answers_match`` (exact match for reverse, numeric equality for math).

A "step" is one rollout batch, as in rlvr_step.py: 16 prompts x 8 completions generated once,
then 2 optimizer steps of 64 completions each. In TRL terms: ``per_device_train_batch_size``
16 (our micro batch per rank), ``gradient_accumulation_steps`` 4 (our 2 ranks x 2 accumulation
steps), ``steps_per_generation`` 8 (so ``generation_batch_size`` is 128), ``num_generations`` 8;
one of our steps is therefore two TRL optimizer steps, and since generation is not aligned with
the optimizer step TRL computes old log-probs in an extra no-grad forward, as our ``logprobs``
phase does. Each TRL optimizer step is timed by a ``TrainerCallback`` (``on_step_begin`` to
``on_step_end``); consecutive pairs are summed into one step, the first step is dropped as a
warm-up and the median of the rest is reported. The phase split comes from timing TRL's own
methods: ``rollout_generate`` is ``_generate`` (tokenize, ``model.generate``, decode),
``rollout_reward`` is ``_calculate_rewards``, ``logprobs`` is the old-log-prob forward,
``advantage`` is the rest of ``_generate_and_score_completions`` (padding, advantages, TRL's
metrics) and ``train`` is everything else in the two optimizer steps. ``generated_tokens_per_s``
is generated tokens over the whole step's time (end to end), as in rlvr_step.py.

What cannot match (also listed under ``differences`` in the JSON):

- Processes: TRL runs as one process here (TRL on CPU has no multi-process launch in this
  setup), plain PyTorch without ZeRO, with ``--threads`` intra-op threads; by default it runs
  once with 1 and once with 2 (the two CPU slots our run uses), and on a busy box 2 threads can
  be many times slower than 1. Ours runs 2 DeepSpeed ZeRO-3 trainer ranks, a vLLM engine and
  reward workers as Ray actors with one thread each. TRL accumulates 4 micro batches where each
  of our ranks accumulates 2.
- Generation: TRL samples with transformers ``generate`` from the training model itself, so it
  has no weight sync (``sync`` is 0) but decodes the whole padded batch until every sequence
  stops; ours generates with vLLM after gathering and syncing the merged weights.
- Rewards: TRL scores in-process with ``answers_match``; our reward actors use math-verify
  (``math_rule``) and ``exact_match``, called through Ray.
- Sampling is random in both, so completion lengths (and hence tokens per step) differ a little.
- ``step`` here excludes TRL's logging between optimizer steps and the data loader's fetch of
  the prompts; ours is the sum of its phases. ``start_s`` is model load plus trainer set-up
  (ours: Ray, actors and vLLM); runs after the first in one process have their imports paid.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.rlvr_step import (  # noqa: E402
    MODELS,
    PHASES,
    dtype_overrides,
    model_overrides,
    result_line,
    write_results,
)
from roll_ds.data.dataset import answers_match  # noqa: E402

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig

ALIASES = {"medium": "qwen2-20m"}
# Our loss aggregation / advantage estimator -> the TRL option that computes the same thing.
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
REWARD_SCALING = {"grpo": "group", "dr_grpo": "none"}
# Our lr_scheduler_type (warm-up is linear in all of them) -> transformers' name.
SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
DIFFERENCES = (
    "one process, plain PyTorch with --threads intra-op threads, no ZeRO (ours: 2 ZeRO-3 ranks, "
    "a vLLM actor and reward actors on Ray, 1 thread each)",
    "each optimizer step accumulates 4 micro batches of 16 in one process (ours: 2 per rank)",
    "generation with transformers generate on the training model: no weight sync, the padded "
    "batch decodes until every sequence stops (ours: vLLM after a weight sync)",
    "rewards in-process with answers_match (ours: math-verify / exact_match in Ray actors)",
    "step excludes TRL's logging between optimizer steps and the prompt fetch",
)


def task_reward(
    completions: Sequence[str], ground_truth: Sequence[str], domain: Sequence[str], **_: Any
) -> list[float]:
    """1.0 where the completion answers the task (``answers_match``), else 0.0."""
    return [
        float(answers_match(text, truth, dom))
        for text, truth, dom in zip(completions, ground_truth, domain, strict=True)
    ]


def trl_settings(cfg: RLVRConfig) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments equal to ``cfg``'s, for one process.

    One rollout batch (``rollout_batch_size`` x group samples) is generated at once and trained
    on in as many optimizer steps as our ranks take, each over as many samples as ours.
    """
    from roll_ds.config.device_mapping import parse_device_mapping

    algo, train, gen = cfg.algorithm, cfg.actor_train, cfg.actor_infer.generating_args
    targs = train.training_args
    problems = []
    if algo.loss_agg_mode not in LOSS_TYPES:
        problems.append(f"algorithm.loss_agg_mode must be one of {sorted(LOSS_TYPES)}")
    if algo.adv_estimator not in REWARD_SCALING:
        problems.append(f"algorithm.adv_estimator must be one of {sorted(REWARD_SCALING)}")
    if targs.lr_scheduler_type not in SCHEDULERS:
        problems.append(f"lr_scheduler_type must be one of {sorted(SCHEDULERS)}")
    ranks = len(parse_device_mapping(train.device_mapping))
    micro = targs.per_device_train_batch_size
    per_optimizer_step = micro * targs.gradient_accumulation_steps * ranks
    samples = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    if samples % per_optimizer_step:
        problems.append(
            f"a rollout batch of {samples} samples is not a whole number of optimizer steps "
            f"of {per_optimizer_step}"
        )
    if problems:
        raise ValueError("TRL cannot mirror this config: " + "; ".join(problems))
    return {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": per_optimizer_step // micro,
        "steps_per_generation": samples // micro,
        "num_generations": cfg.num_return_sequences_in_group,
        "num_iterations": algo.ppo_epochs,
        "max_completion_length": cfg.response_length,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": max(gen.top_k, 0),
        "learning_rate": targs.learning_rate,
        "weight_decay": targs.weight_decay,
        "adam_beta1": targs.adam_beta1,
        "adam_beta2": targs.adam_beta2,
        "adam_epsilon": targs.adam_epsilon,
        "warmup_steps": targs.warmup_steps,
        "lr_scheduler_type": SCHEDULERS[targs.lr_scheduler_type],
        "max_grad_norm": targs.max_grad_norm,
        "epsilon": algo.clip_low,
        "epsilon_high": algo.clip_high,
        "beta": algo.kl_coef,
        "loss_type": LOSS_TYPES[algo.loss_agg_mode],
        "scale_rewards": REWARD_SCALING[algo.adv_estimator],
        "mask_truncated_completions": algo.mask_truncated,
        "gradient_checkpointing": not train.model_args.disable_gradient_checkpointing,
        "seed": cfg.seed,
        "shuffle_dataset": False,  # the prompts are already in our sampler's order
    }


def planned_prompts(cfg: RLVRConfig, steps: int) -> list[list[dict]]:
    """The prompt batches our pipeline draws in its first ``steps`` steps."""
    from roll_ds.data.dataset import load_jsonl_rows
    from roll_ds.data.sampler import PromptSampler

    data = cfg.actor_train.data_args
    rows = [r for path in data.file_name for r in load_jsonl_rows(path, data.default_domain)]
    rows = rows[: data.max_samples] if data.max_samples else rows
    sampler = PromptSampler(rows, seed=cfg.seed, domain_probs=dict(data.domain_interleave_probs))
    return [list(sampler.next_batch(cfg.rollout_batch_size)) for _ in range(steps)]


def fold(values: Sequence[float], size: int) -> list[float]:
    """Sums of consecutive runs of ``size`` values (TRL optimizer steps -> our steps)."""
    if len(values) % size:
        raise ValueError(f"{len(values)} values do not split into runs of {size}")
    return [sum(values[i : i + size]) for i in range(0, len(values), size)]


def phase_row(step_s: float, batch: Mapping[str, float]) -> dict[str, float]:
    """rlvr_step.py's phases for one step from its time and its generation batch's timings."""
    rollout = batch["generate"] + batch["reward"]
    return {
        "sync": 0.0,
        "rollout": rollout,
        "rollout_generate": batch["generate"],
        "rollout_reward": batch["reward"],
        "logprobs": batch["logprobs"],
        "advantage": batch["prepare"] - rollout - batch["logprobs"],
        "train": step_s - batch["prepare"],
        "rollout_wait": 0.0,  # one process, nothing overlaps
        "step": step_s,
    }


# GRPOTrainer's internal methods timed below (as of TRL 1.16).
TIMED_METHODS = (
    "_generate_and_score_completions",
    "_generate",
    "_calculate_rewards",
    "_get_per_token_logps_and_entropies",
)


def _instrumented_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` recording, per generation batch, the time of each phase and the tokens
    and prompts it generated (``self.batches``)."""
    missing = [m for m in TIMED_METHODS if not hasattr(trainer_cls, m)]
    if missing:
        raise RuntimeError(f"{trainer_cls.__name__} has no {missing}; this script targets TRL 1.16")

    class Timed(trainer_cls):
        batches: list[dict[str, Any]]
        _current: dict[str, Any] | None = None

        def _generate_and_score_completions(self, inputs):
            if not self.model.training:
                return super()._generate_and_score_completions(inputs)
            self._current = {"generate": 0.0, "reward": 0.0, "logprobs": 0.0, "tokens": 0}
            self._current["prompts"] = [x["prompt"] for x in inputs]
            started = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self._current["prepare"] = time.perf_counter() - started
                self.batches.append(self._current)
                self._current = None

        def _generate(self, prompts):
            started = time.perf_counter()
            out = super()._generate(prompts)
            if self._current is not None:
                self._current["generate"] += time.perf_counter() - started
                self._current["tokens"] += sum(len(ids) for ids in out[1])
            return out

        def _calculate_rewards(self, *args, **kwargs):
            started = time.perf_counter()
            out = super()._calculate_rewards(*args, **kwargs)
            if self._current is not None:
                self._current["reward"] += time.perf_counter() - started
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            started = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if self._current is not None:  # the no-grad old-log-prob forward, not the loss's
                self._current["logprobs"] += time.perf_counter() - started
            return out

    return Timed


def _step_timer() -> Any:
    """A ``TrainerCallback`` recording the seconds of every optimizer step (``.seconds``)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._started)

    return StepTimer()


def optimizer_steps_per_rollout(settings: Mapping[str, Any]) -> int:
    """TRL optimizer steps per generation batch under ``trl_settings``' output."""
    return settings["steps_per_generation"] // settings["gradient_accumulation_steps"]


def build_trainer(
    cfg: RLVRConfig,
    settings: Mapping[str, Any],
    batches: list[list[dict]],
    output_dir: Path,
    callbacks: list[Any],
) -> Any:
    """An instrumented ``GRPOTrainer`` with ``settings`` over exactly the prompt ``batches``."""
    # TRL 1.16 warns on import that it was tested with vLLM <= 0.31; it does not use vLLM here.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    import trl
    from datasets import Dataset
    from peft import TaskType
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_ds.models.loading import lora_config
    from roll_ds.models.shipped import resolve_pretrain
    from roll_ds.models.tensors import torch_dtype

    args = trl.GRPOConfig(
        output_dir=str(output_dir),
        max_steps=len(batches) * optimizer_steps_per_rollout(settings),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **settings,
    )
    margs = cfg.actor_train.model_args
    lora = lora_config(
        task_type=TaskType.CAUSAL_LM,
        rank=margs.lora_rank,
        alpha=margs.lora_alpha,
        dropout=margs.lora_dropout,
        target=margs.lora_target,
        field="actor_train.model_args",
    )
    columns = ("prompt", "ground_truth", "domain")
    dataset = Dataset.from_list([{k: row[k] for k in columns} for b in batches for row in b])
    model_dir = resolve_pretrain(cfg.pretrain)
    trainer = _instrumented_trainer(trl.GRPOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(margs.dtype)),
        reward_funcs=task_reward,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=lora,
        callbacks=callbacks,
    )
    trainer.batches = []
    return trainer


def bench(name: str, steps: int, work: Path, threads: int, dtype: str | None = None) -> dict:
    import torch
    import trl

    from roll_ds.config import load_config

    torch.set_num_threads(threads)
    cfg = load_config("rlvr_lora_zero3", [*model_overrides(name, work), *dtype_overrides(dtype)])
    settings = trl_settings(cfg)
    planned = planned_prompts(cfg, steps)
    timer = _step_timer()
    started = time.perf_counter()
    trainer = build_trainer(cfg, settings, planned, work / f"trl_{name}", [timer])
    start_s = time.perf_counter() - started
    trainer.train()

    batches = trainer.batches
    optimizer_steps = optimizer_steps_per_rollout(settings)
    step_s = fold(timer.seconds, optimizer_steps)
    rows = [phase_row(s, b) for s, b in zip(step_s, batches, strict=True)]
    group = cfg.num_return_sequences_in_group
    same_prompts = all(
        sorted(b["prompts"]) == sorted(r["prompt"] for r in p for _ in range(group))
        for b, p in zip(batches, planned, strict=True)
    )
    timed = slice(1, None) if len(rows) > 1 else slice(None)  # the first step pays warm-ups
    median_s = {p: statistics.median(r[p] for r in rows[timed]) for p in PHASES}
    return {
        "model": name,
        "engine": "trl",
        "trl_version": trl.__version__,
        "threads": threads,
        "dtype": cfg.actor_train.model_args.dtype,
        "start_s": start_s,
        "steps_timed": len(rows[timed]),
        "samples_per_step": cfg.rollout_batch_size * group,
        "response_length": cfg.response_length,
        "optimizer_steps_per_step": optimizer_steps,
        "step_s": median_s["step"],
        "median_s": median_s,
        "generated_tokens_per_step": statistics.median(b["tokens"] for b in batches[timed]),
        "generated_tokens_per_s": statistics.median(
            b["tokens"] / r["step"] for b, r in zip(batches[timed], rows[timed], strict=True)
        ),
        "per_step": rows,
        "trl_optimizer_step_s": timer.seconds,
        "reward_mean_per_step": [e["reward"] for e in trainer.state.log_history if "reward" in e],
        "same_prompts": same_prompts,
        "trl_config": settings,
        "differences": list(DIFFERENCES),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=[*MODELS, *ALIASES], default=list(MODELS))
    parser.add_argument("--steps", type=int, default=5, help="steps to run, the first untimed")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch intra-op threads; one run each",
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        help="the model's dtype (default: the config's, fp32); bf16 loads the weights in bf16, "
        "as our model_args.dtype=bf16 does",
    )
    parser.add_argument("--out", default="benchmarks/results/trl_grpo_step.json")
    parser.add_argument("--work-dir", default="output/benchmarks")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    results = [
        bench(ALIASES.get(model, model), args.steps, work, threads, args.dtype)
        for model in args.models
        for threads in args.threads
    ]
    print("\nTRL GRPOTrainer: median seconds per step (one rollout batch) after a warm-up step")
    for r in results:
        print(f"{r['model']:10s} {r['threads']} thread(s) {result_line(r)}")
    write_results(results, args.out)


if __name__ == "__main__":
    main()
