"""Held-out accuracy curves of the embedded default over seeds, one curve band per variant.

    python benchmarks/learning_curves.py                       # sync vs async, seeds 42 1 2
    python benchmarks/learning_curves.py --seeds 42 1 2 3 --out docs/async_vs_sync.png
    python benchmarks/learning_curves.py --config agentic_lora_zero3 --variants sync \
        --out benchmarks/results/agentic_curves.png            # the agentic default

Each (variant, seed) is one `python run.py --config-name <config> seed=S ...` in its own
process, one after the other. Prints the held-out metric per step for every run
(``eval/accuracy``; an agentic run: ``eval/success`` and each environment's
``eval/<env>/success``) and each variant's range at the last step, writes the numbers as JSON
next to the picture, and plots the mean with the min-max band of every variant against the
training step.
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


# the curve drawn per config (an agentic run also records each environment's eval/<env>/success)
HEADLINE = {"rlvr_lora_zero3": "eval/accuracy", "agentic_lora_zero3": "eval/success"}


def eval_curves(
    config: str, seed: int, overrides: list[str], work: Path
) -> dict[str, list[tuple[int, float]]]:
    """Every held-out accuracy/success metric of one run, each as ``[(step, value), ...]``."""
    out = work / f"seed{seed}_{abs(hash(tuple(overrides)))}"
    cmd = [sys.executable, "run.py", "--config-name", config, f"seed={seed}"]
    subprocess.run([*cmd, f"output_dir={out}", *overrides], cwd=ROOT, check=True)
    rows = [json.loads(line) for line in (out / config / "metrics.jsonl").open()]
    held_out = ("accuracy", "success")
    keys = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith(held_out)})
    return {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}


def plot(curves: dict[str, list[list[tuple[int, float]]]], path: Path, title: str) -> None:
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
    ax.set_title(f"{title}: min-max over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(HEADLINE), default="rlvr_lora_zero3")
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default="benchmarks/results/learning_curves.png")
    args = parser.parse_args()

    headline = HEADLINE[args.config]
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    metrics: dict[str, list[dict[str, list[tuple[int, float]]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            for seed in args.seeds:
                run = eval_curves(args.config, seed, VARIANTS[name], Path(tmp))
                curves.setdefault(name, []).append(run[headline])
                metrics.setdefault(name, []).append(run)
                for key, curve in run.items():
                    print(f"{name} seed {seed} {key}: {[(s, round(a, 4)) for s, a in curve]}")
    for name, runs in curves.items():
        first = [run[0][1] for run in runs]
        last = [run[-1][1] for run in runs]
        gains = [b - a for a, b in zip(first, last, strict=True)]
        print(
            f"{name}: last-step {headline} {min(last):.3f}-{max(last):.3f}, "
            f"gain {min(gains):+.3f} to {max(gains):+.3f} over seeds {args.seeds}"
        )
    out = Path(args.out)
    plot(curves, out, args.config)
    command = " ".join(["python", "benchmarks/learning_curves.py", *sys.argv[1:]])
    record = {"command": command, "config": args.config, "seeds": args.seeds, "curves": curves}
    from roll_ds.host import with_host  # the host with the figures

    out.with_suffix(".json").write_text(json.dumps(with_host({**record, "metrics": metrics})))
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
