"""Time the train phase with padded row-count micro-batches, token-budget micro-batches, and
token-budget micro-batches packed without padding (``max_tokens_per_micro_batch``,
``use_sequence_packing``; strategies/micro_batches.py).

    python benchmarks/train_packing.py                    # ~20M Qwen2, 64 rows, 1 CPU rank
    python benchmarks/train_packing.py --model embedded --rows 32 --out /tmp/packing.json

The real ``deepspeed_train`` strategy (ZeRO-0, fp32, one rank) trains one mixed-length batch:
prompts of ``--prompt`` tokens, responses uniformly 8 to ``--max-response`` tokens,
right-padded, with the actor's PPO loss. Each setting has its own engine built from the same
checkpoint; after a dropped warm-up ``train_step`` and log-prob pass (``compute_logprobs``) of
each, ``--repeats`` rounds time every setting once in turn (round-robin, so that a loaded
machine's drift hits them alike), and the medians of wall and CPU seconds are reported (CPU
seconds of the process, steadier than wall time on a shared box, best with ``--threads 1``). The
optimizer-step structure is the same in every setting (``--micro`` x ``--accum`` rows per
optimizer step); the token budget defaults to what a row-count micro-batch holds padded
(``micro x longest row``), so no setting uses more activation memory than the padded one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {  # name: (max_tokens_per_micro_batch is set, use_sequence_packing)
    "rows_padded": (False, False),
    "rows_packed": (False, True),
    "tokens": (True, False),
    "tokens_packed": (True, True),
}


def make_batch(rows: int, prompt: int, max_response: int, vocab: int, seed: int = 0) -> dict:
    """Right-padded prompt + response rows with the columns ``PolicyLoss`` reads."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, max_response + 1, (rows,), generator=g).tolist()
    width = prompt + max(lengths)
    input_ids = torch.randint(3, vocab, (rows, width), generator=g)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    response_mask = torch.zeros(rows, width - 1)
    for b, length in enumerate(lengths):
        attention_mask[b, : prompt + length] = 1
        response_mask[b, prompt - 1 : prompt - 1 + length] = 1.0
    noise = lambda: -4.0 + 0.3 * torch.randn(rows, width - 1, generator=g)  # noqa: E731
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "loss_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, width - 1).contiguous(),
        "old_logprobs": noise(),
        "ref_logprobs": noise(),
        "rollout_logprobs": noise(),
    }


def policy_loss():
    from roll_ds.pipeline.loss_fns import PolicyLoss

    return PolicyLoss(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=None,
        ratio_level="token",
        agg_mode="token-mean",
        kl_coef=0.0,
        kl_estimator="k3",
        entropy_coef=0.0,
        tis_cap=None,
        norm_constant=256.0,
    )


def build_strategy(model_dir: str, args: argparse.Namespace, budget: int | None, packed: bool):
    import yaml

    from roll_ds.config.schema import ModelArgs, TrainingArgs
    from strategies.deepspeed.train import DeepSpeedTrainStrategy

    preset = Path(__file__).resolve().parents[1] / "examples" / "config" / "deepspeed_zero.yaml"
    strategy = DeepSpeedTrainStrategy(
        model_path=model_dir,
        strategy_config=yaml.safe_load(preset.read_text())["deepspeed_zero"],
        model_args=ModelArgs(attn_implementation=args.attn),
        training_args=TrainingArgs(
            learning_rate=1e-6,
            per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=args.accum,
        ),
        max_steps=100,
        infer_batch_size=args.micro,
        max_tokens_per_micro_batch=budget,
        use_sequence_packing=packed,
    )
    strategy.initialize()
    return strategy


def seconds(fn) -> tuple[float, float]:
    """Wall and CPU seconds (this process, every thread) of ``fn()``."""
    started, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - started, time.process_time() - cpu


def measure(names: list[str], model_dir: str, args: argparse.Namespace, batch: dict, budget: int):
    """Every setting's train_step and log-prob pass times, the settings in turn each round."""
    loss = policy_loss()
    strategies = {}
    try:
        for name in names:
            uses_budget, packed = SETTINGS[name]
            strategies[name] = build_strategy(
                model_dir, args, budget if uses_budget else None, packed
            )
        jobs = {
            name: (
                lambda s=s: s.train_step(batch, loss),
                lambda s=s: s.compute_logprobs(batch["input_ids"], batch["attention_mask"]),
            )
            for name, s in strategies.items()
        }
        for train, logprobs in jobs.values():  # warm-up, dropped
            train(), logprobs()
        keys = ("train_s", "train_cpu_s", "logprobs_s", "logprobs_cpu_s")
        times = {name: {key: [] for key in keys} for name in names}
        for round_ in range(args.repeats):
            for name, (train, logprobs) in jobs.items():
                for job, key in ((train, "train"), (logprobs, "logprobs")):
                    wall, cpu = seconds(job)
                    times[name][f"{key}_s"].append(wall)
                    times[name][f"{key}_cpu_s"].append(cpu)
            print(f"  round {round_ + 1}/{args.repeats} done", flush=True)
    finally:
        for s in strategies.values():
            s.close()
    return [
        {
            "setting": name,
            "max_tokens_per_micro_batch": budget if SETTINGS[name][0] else None,
            "use_sequence_packing": SETTINGS[name][1],
            **times[name],
            **{f"{k}_median": statistics.median(v) for k, v in times[name].items()},
        }
        for name in names
    ]


def model_dir_for(name: str, cache: Path) -> str:
    if name == "embedded":
        from roll_ds.models.shipped import resolve_pretrain

        return resolve_pretrain("embedded:tiny-qwen2")
    from benchmarks.rlvr_step import build_medium_model

    return build_medium_model(cache)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("qwen2-20m", "embedded"), default="qwen2-20m")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--accum", type=int, default=8)
    parser.add_argument("--budget", type=int, default=None, help="default: micro x longest row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "roll_ds_bench"))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rows % (args.micro * args.accum):
        parser.error("--rows must be a multiple of --micro x --accum (whole optimizer steps)")
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir_for(args.model, cache)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = make_batch(args.rows, args.prompt, args.max_response, vocab)
    width = batch["input_ids"].shape[1]
    budget = args.budget or args.micro * width
    real = int(batch["attention_mask"].sum())
    print(
        f"{args.model}: {args.rows} rows, width {width}, {real} real tokens "
        f"({real / (args.rows * width):.0%} of the padded batch); micro {args.micro} x accum "
        f"{args.accum}; token budget {budget}; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    results = measure(args.settings, model_dir, args, batch, budget)
    for r in results:
        print(
            f"  {r['setting']:14s} train {r['train_s_median']:7.2f} s (CPU "
            f"{r['train_cpu_s_median']:7.2f} s)   logprobs {r['logprobs_s_median']:6.2f} s (CPU "
            f"{r['logprobs_cpu_s_median']:6.2f} s)   train runs "
            f"{[round(t, 1) for t in r['train_s']]}",
            flush=True,
        )
    by_name = {r["setting"]: r for r in results}
    ratios = {}
    if "rows_padded" in by_name:
        base = by_name["rows_padded"]
        for r in results:
            ratios[r["setting"]] = ratio = {
                key: base[f"{key}_median"] / r[f"{key}_median"]
                for key in ("train_s", "train_cpu_s", "logprobs_s", "logprobs_cpu_s")
            }
            print(
                f"  {r['setting']:14s} vs rows_padded: train x{ratio['train_s']:.2f} (CPU "
                f"x{ratio['train_cpu_s']:.2f}), logprobs x{ratio['logprobs_s']:.2f} (CPU "
                f"x{ratio['logprobs_cpu_s']:.2f})"
            )
    if args.out:
        from roll_ds.host import host_record  # the host with the figures

        Path(args.out).write_text(
            json.dumps(
                {
                    "model": args.model,
                    "rows": args.rows,
                    "width": width,
                    "real_tokens": real,
                    "micro": args.micro,
                    "accum": args.accum,
                    "budget": budget,
                    "attn": args.attn,
                    "torch_threads": torch.get_num_threads(),
                    "results": results,
                    "speedups_vs_rows_padded": ratios,
                    "host": host_record(),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
