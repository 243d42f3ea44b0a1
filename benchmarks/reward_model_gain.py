"""Does the embedded reward model teach? Held-out accuracy, judged by the RULE verifier, of the
embedded default trained with the reward model alone, with reward model + rule, and (for
reference) with the rule alone.

    python benchmarks/reward_model_gain.py                          # 3 configs x seeds 42 1 2
    python benchmarks/reward_model_gain.py --configs rlvr_lora_zero3_rm --seeds 42

Each (config, seed) is one `nice -n 10 python run.py --config-name CONFIG seed=S` in its own
process, one after the other. In the reward-model configs the rule is a weight-0 term: it does
not move the reward, but `eval/accuracy` is its verdict. Prints a table of eval/accuracy at
step 0 and at the last step and writes every curve to benchmarks/results/reward_model_gain.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("rlvr_lora_zero3_rm", "rlvr_lora_zero3_rm_mix", "rlvr_lora_zero3")


def eval_curve(config: str, seed: int, work: Path, extra: list[str]) -> dict:
    out = work / f"{config}_seed{seed}"
    cmd = ["nice", "-n", "10", sys.executable, "run.py", "--config-name", config]
    start = time.perf_counter()
    subprocess.run(
        [*cmd, f"seed={seed}", f"output_dir={out}", "tracking.tensorboard=false", *extra],
        cwd=ROOT,
        check=True,
    )
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / config / "metrics.jsonl").open()]
    curve = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"config": config, "seed": seed, "curve": curve, "seconds": round(seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/reward_model_gain.json"
    )
    parser.add_argument("overrides", nargs="*", help="extra run.py overrides for every run")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rm_gain_") as tmp:
        for config in args.configs:
            for seed in args.seeds:
                runs.append(eval_curve(config, seed, Path(tmp), args.overrides))
                args.out.parent.mkdir(parents=True, exist_ok=True)
                from roll_ds.host import with_host  # the host with the figures

                # partial results too
                args.out.write_text(json.dumps(with_host(runs), indent=2) + "\n")
    print(f"\n{'config':<26} {'seed':>4}  step 0 -> last  gain (points)  curve")
    for run in runs:
        (_, first), (last_step, last) = run["curve"][0], run["curve"][-1]
        curve = " / ".join(f"{a:.3g}" for _, a in run["curve"])
        print(
            f"{run['config']:<26} {run['seed']:>4}  {first:.4f} -> {last:.4f} (step {last_step})"
            f"  {100 * (last - first):+.1f}  {curve}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
