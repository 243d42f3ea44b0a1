"""roll_ds against TRL's GRPOTrainer, back to back in one invocation, on the same settings.

    pip install -e .[bench]                       # TRL, for the peer's side
    python benchmarks/versus_trl.py      # both models: ours sync and async, TRL 1 and 2 threads
    python benchmarks/versus_trl.py --models embedded --steps 6 --variants sync async
    python benchmarks/versus_trl.py \
        --extra 'actor_train.strategy_args.strategy_config=${deepspeed_zero2}'
    python benchmarks/versus_trl.py --models qwen2-20m --dtype bf16   # both sides in bf16

Each run is its own process (``rlvr_step.py`` for ours, ``trl_grpo_step.py`` for TRL), one after
the other, so they share the box but never run at the same time. Prints, per model, the median
step time, generated tokens/s, samples/s and (ours) the trainer's mean MFU of every run with the
phase split, and each of ours as a speed-up over TRL's best thread setting (> 1: roll_ds is
faster); writes all of it as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.rlvr_step import dtype_overrides  # noqa: E402

MODELS = ("embedded", "qwen2-20m")
# Our variants: config overrides on top of rlvr_step.py's settings.
VARIANTS = {
    "sync": [],  # the config as shipped (rlvr_lora_zero3: old_logprobs=auto)
    "sync_recompute": ["algorithm.old_logprobs=recompute"],  # the trainer's log-prob pass
    "sync_reuse": ["algorithm.old_logprobs=auto"],
    # vLLM with torch.compile (the preset skips it: about 15-40 s more at start on CPU)
    "sync_compiled": ["actor_infer.strategy_args.strategy_config.enforce_eager=false"],
    "async": ["async_generation.max_staleness=1"],
    "async_rollout": ["async_generation.max_staleness=1", "algorithm.old_logprobs=rollout"],
    "async2_rollout": ["async_generation.max_staleness=2", "algorithm.old_logprobs=rollout"],
    # streaming generation: a sync pauses the engines between decode steps instead of waiting
    # for the batches in flight (async_generation.mode=stream)
    "stream_rollout": [
        "async_generation.max_staleness=1",
        "async_generation.mode=stream",
        "algorithm.old_logprobs=rollout",
    ],
    "stream2_rollout": [
        "async_generation.max_staleness=2",
        "async_generation.mode=stream",
        "algorithm.old_logprobs=rollout",
    ],
}
PHASES = ("rollout_generate", "logprobs", "train", "sync")


def run_json(script: str, args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, str(HERE / script), *args, "--out", str(out)], check=True)
        return json.loads(out.read_text())


def ours(model: str, variant: str, steps: int, extra: list[str]) -> dict:
    [result] = run_json(
        "rlvr_step.py", ["--models", model, "--steps", str(steps), *VARIANTS[variant], *extra]
    )
    return {"who": f"roll_ds {variant}", **result}


def trl(model: str, threads: list[int], steps: int, dtype: str | None) -> list[dict]:
    args = ["--models", model, "--steps", str(steps), "--threads", *map(str, threads)]
    if dtype is not None:
        args += ["--dtype", dtype]
    results = run_json("trl_grpo_step.py", args)
    return [{"who": f"TRL {r['threads']} thread(s)", **r} for r in results]


def step_s(result: dict) -> float:
    return result["median_s"]["step"]


def table(model: str, results: list[dict]) -> str:
    peers = [r for r in results if r["who"].startswith("TRL")]
    best = min(peers, key=step_s) if peers else None
    lines = [
        f"\n{model}: median s/step; phases generate / logprobs / train / sync",
        f"{'run':22s} {'step s':>7s} {'tok/s':>7s} {'samples/s':>9s} {'MFU':>6s}  phases"
        + (f"   x vs {best['who']}" if best else ""),
    ]
    for r in results:
        samples_s = r["samples_per_step"] / step_s(r)
        tokens_s = r["generated_tokens_per_step"] / step_s(r)
        median = {**r["median_s"]}
        # results written before the one rollout path timed the async sync apart
        median["sync"] = median.get("sync", 0.0) + median.get("sync_after", 0.0)
        phases = " / ".join(f"{median.get(p, 0.0):.2f}" for p in PHASES)
        ratio = f"   {step_s(best) / step_s(r):.2f}x" if best and r is not best else ""
        # the trainer's mean MFU (rlvr_step.py's mean_perf); TRL's runs report none
        mfu = r.get("mean_perf", {}).get("mfu")
        mfu_cell = f"{mfu:6.1%}" if mfu is not None else f"{'-':>6s}"
        lines.append(
            f"{r['who']:22s} {step_s(r):7.2f} {tokens_s:7.0f} {samples_s:9.1f} {mfu_cell}  "
            f"{phases}{ratio}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["sync", "async"])
    parser.add_argument(
        "--threads", nargs="*", type=int, default=[1, 2], help="TRL's threads (none: skip TRL)"
    )
    parser.add_argument("--steps", type=int, default=6, help="steps per run, the first untimed")
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for our runs")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        help="both sides' model dtype (default: the config's, fp32); bf16 pays on CPUs with "
        "AMX (amx_bf16 in /proc/cpuinfo)",
    )
    parser.add_argument("--out", default="benchmarks/results/versus_trl.json")
    args = parser.parse_args()
    if args.threads and importlib.util.find_spec("trl") is None:
        parser.error("TRL is not installed: pip install -e '.[bench]' (--threads alone skips it)")

    report: dict[str, list[dict]] = {}
    for model in args.models:
        extra = [*dtype_overrides(args.dtype), *args.extra]
        results = [ours(model, v, args.steps, extra) for v in args.variants]
        if args.threads:
            results += trl(model, args.threads, args.steps, args.dtype)
        report[model] = results
        print(table(model, results), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    out.write_text(json.dumps(with_host(report), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
