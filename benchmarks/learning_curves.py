"""Held-out accuracy curves of the embedded default over seeds, one curve band per variant.

    python benchmarks/learning_curves.py                       # sync vs async, seeds 42 1 2
    python benchmarks/learning_curves.py --seeds 42 1 2 3 --out docs/async_vs_sync.png

Each (variant, seed) is one `python run.py --config-name rlvr_lora_zero3 seed=S ...` in its own
process, one after the other. Prints eval/accuracy per step for every run and each variant's
range at the last step, writes the numbers as JSON next to the picture, and plots the mean with
the min-max band of every variant against the training step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "sync": [],
    "async (max_staleness 1)": ["async_generation.max_staleness=1"],
    "async, rollout log-probs as old": [
        "async_generation.max_staleness=1",
        "algorithm.old_logprobs=rollout",
    ],
    "stream (max_staleness 2)": [
        "async_generation.max_staleness=2",
        "async_generation.mode=stream",
    ],
}


def eval_curve(seed: int, overrides: list[str], work: Path) -> list[tuple[int, float]]:
    out = work / f"seed{seed}_{abs(hash(tuple(overrides)))}"
    cmd = [sys.executable, "run.py", "--config-name", "rlvr_lora_zero3", f"seed={seed}"]
    subprocess.run([*cmd, f"output_dir={out}", *overrides], cwd=ROOT, check=True)
    rows = [json.loads(line) for line in (out / "rlvr_lora_zero3" / "metrics.jsonl").open()]
    return [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def plot(curves: dict[str, list[list[tuple[int, float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in curves.items():
        steps = [s for s, _ in runs[0]]
        values = list(zip(*[[a for _, a in run] for run in runs], strict=True))
        mean = [sum(v) / len(v) for v in values]
        ax.plot(steps, mean, marker="o", label=f"{name} (mean of {len(runs)} seeds)")
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("embedded default (rlvr_lora_zero3): min-max over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default="benchmarks/results/learning_curves.png")
    args = parser.parse_args()

    curves: dict[str, list[list[tuple[int, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            for seed in args.seeds:
                curve = eval_curve(seed, VARIANTS[name], Path(tmp))
                curves.setdefault(name, []).append(curve)
                print(f"{name} seed {seed}: {[(s, round(a, 4)) for s, a in curve]}", flush=True)
    for name, runs in curves.items():
        first = [run[0][1] for run in runs]
        last = [run[-1][1] for run in runs]
        gains = [b - a for a, b in zip(first, last, strict=True)]
        print(
            f"{name}: last-step accuracy {min(last):.3f}-{max(last):.3f}, "
            f"gain {min(gains):+.3f} to {max(gains):+.3f} over seeds {args.seeds}"
        )
    out = Path(args.out)
    plot(curves, out)
    out.with_suffix(".json").write_text(json.dumps({"seeds": args.seeds, "curves": curves}))
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
