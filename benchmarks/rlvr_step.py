"""Time RLVR steps of the real pipeline and break them down by phase.

    python benchmarks/rlvr_step.py                      # embedded default + a ~20M-parameter model
    python benchmarks/rlvr_step.py --models embedded --steps 6 --out /tmp/rlvr_step.json
    python benchmarks/rlvr_step.py --out /tmp/zero2.json \
        'actor_train.strategy_args.strategy_config=${deepspeed_zero2}'   # any config override

For each model the pipeline (Ray, DeepSpeed ZeRO-3 LoRA trainer ranks, vLLM, reward actors) is
started once, a warm-up step is dropped, and the median of the remaining steps is reported for
every phase (sync, rollout, logprobs, advantage, train) with generated tokens per second of
the whole step (end to end), and the mean of the timed steps' ``perf/*`` metrics: the trainer's
TFLOP/s per rank and MFU, and the engines' generated tokens per second of generation
(``perf/generate_tokens_per_s``; async runs: per second waited for). The ~20M model
is a randomly initialised Qwen2 built locally with the embedded tokenizer (quality is irrelevant
to timing); its responses run to the full response length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODELS = ("embedded", "qwen2-20m")  # accepted by --models, see model_overrides

# "rollout" is generation plus reward scoring, also reported apart. Under async_generation
# "rollout_generate" is only the part of generation the step waited for, and "rollout_wait"
# (mode batch) the wait for the steps in flight before the step's sync.
# The per-step ``perf/*`` metrics kept as the timed steps' mean (docs/quickstart.md says what each
# is); a JSON written before they were recorded lacks ``mean_perf``.
PERF = ("perf/tflops", "perf/mfu", "perf/peak_tflops", "perf/generate_tokens_per_s")
PHASES = (
    "sync",
    "rollout",
    "rollout_generate",
    "rollout_reward",
    "logprobs",
    "advantage",
    "train",
    "rollout_wait",
    "step",
)


def build_medium_model(cache: Path) -> str:
    """A ~20M-parameter Qwen2 with the embedded tokenizer, saved once under ``cache``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from roll_ds.models.shipped import resolve_pretrain

    path = cache / "qwen2-20m"
    if (path / "config.json").is_file():
        return str(path)
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrain("embedded:tiny-qwen2"))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def model_overrides(name: str, work: Path) -> list[str]:
    """Config overrides that select model ``name`` (one of ``MODELS``); builds it if needed.

    Shared with benchmarks/trl_grpo_step.py so both benchmarks run the same settings.
    """
    if name == "embedded":
        return []
    if name == "qwen2-20m":
        return [
            f"pretrain={build_medium_model(work)}",
            "response_length=48",
            "prompt_length=32",
            "actor_infer.strategy_args.strategy_config.max_model_len=96",
        ]
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")


def dtype_overrides(dtype: str | None) -> list[str]:
    """Config overrides that set both the trainer's and the rollout engine's dtype (None: the
    config's, fp32); versus_trl.py gives TRL the same through ``trl_grpo_step.py --dtype``."""
    if dtype is None:
        return []
    return [f"actor_train.model_args.dtype={dtype}", f"actor_infer.model_args.dtype={dtype}"]


def bench(name: str, overrides: list[str], steps: int, out_dir: Path) -> dict:
    from roll_ds.config import load_config
    from roll_ds.pipeline.rlvr import RLVRPipeline

    cfg = load_config(
        "rlvr_lora_zero3",
        [
            f"max_steps={steps}",
            "eval_steps=0",
            "save_steps=0",
            "tracking.tensorboard=false",
            "tracking.dump_rollouts_every=0",
            f"output_dir={out_dir}",
            f"exp_name=bench_{name}",
            *overrides,
        ],
    )
    pipeline = RLVRPipeline(cfg)
    started = time.perf_counter()
    pipeline.start()
    start_s = time.perf_counter() - started
    try:
        rows = [pipeline.train_one_step(step) for step in range(steps)]
    finally:
        pipeline.shutdown()
    timed = rows[1:] if len(rows) > 1 else rows  # the first step pays one-off warm-ups
    samples = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    return {
        "model": name,
        "start_s": start_s,
        "steps_timed": len(timed),
        "samples_per_step": samples,
        "response_length": cfg.response_length,
        "median_s": {p: statistics.median(r.get(f"time/{p}", 0.0) for r in timed) for p in PHASES},
        "generated_tokens_per_step": statistics.median(
            r["rollout/response_length"]
            * cfg.rollout_batch_size
            * cfg.num_return_sequences_in_group
            for r in timed
        ),
        "generated_tokens_per_s": statistics.median(
            r["throughput/generated_tokens_per_s"] for r in timed
        ),
        # the sync phase split: moving the weights (gather + transfer + load) and parity probe
        "sync_bytes": statistics.median(r["sync/bytes"] for r in timed),
        "sync_transfer_s": statistics.median(r["sync/seconds"] for r in timed),
        "sync_parity_s": statistics.median(r.get("sync/parity_seconds", 0.0) for r in timed),
        "mean_perf": mean_perf(timed),
    }


def mean_perf(rows: list[dict]) -> dict[str, float]:
    """The mean over ``rows`` of each ``PERF`` metric they all carry (``perf/mfu`` -> ``mfu``):
    a mean, not a median, so that it is the figure of the run's total work."""
    return {
        key.removeprefix("perf/"): statistics.fmean(r[key] for r in rows)
        for key in PERF
        if rows and all(key in r for r in rows)
    }


def result_line(r: dict) -> str:
    """One result's medians on a line: start-up, each phase, generated tokens/s."""
    phases = "  ".join(f"{p} {r['median_s'][p]:.2f}s" for p in PHASES)
    perf = r.get("mean_perf", {})
    train = (
        f" | train {perf['tflops']:.3g} TFLOP/s per rank, MFU {perf['mfu']:.1%}"
        if "mfu" in perf
        else ""
    )
    return (
        f"start {r['start_s']:.1f}s | {phases} | {r['generated_tokens_per_s']:.0f} generated "
        f"tok/s ({r['generated_tokens_per_step']:.0f} tok/step){train}"
    )


def write_results(results: list[dict], path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    out.write_text(json.dumps(with_host(results), indent=1))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/rlvr_step.json")
    parser.add_argument("--work-dir", default="output/benchmarks")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="extra config overrides for every model, e.g. "
        '"actor_train.strategy_args.strategy_config=${deepspeed_zero2}"',
    )
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    results = []
    for name in args.models:
        overrides = [*model_overrides(name, work), *args.overrides]
        results.append(bench(name, overrides, args.steps, work))
        r = results[-1]
        r["overrides"] = args.overrides
        print(
            f"{name:10s} {result_line(r)}, {r['samples_per_step']} samples per step; sync "
            f"{r['sync_bytes'] / 1e6:.2f} MB in {r['sync_transfer_s']:.2f}s + parity probe "
            f"{r['sync_parity_s']:.2f}s"
        )
    write_results(results, args.out)


if __name__ == "__main__":
    main()
