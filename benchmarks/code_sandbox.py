"""The code reward's throughput: N right programs scored through the sandbox, programs/s.

    python benchmarks/code_sandbox.py                    # 200 programs, num_workers 2
    python benchmarks/code_sandbox.py --n 400 --workers 4 --out /tmp/code_sandbox.json

Each sample is a small program (read an integer, print its square) with one test case, so every
sample is one sandbox run: the figure is the sandbox's own cost per run (process start, the
isolation, the interpreter's start-up), not the program's. One warm-up batch first (the probe).
Besides programs/s (wall clock: it moves with the box's load), the CPU time per program of
every process a run starts (launcher, bwrap, the program; ``RUSAGE_CHILDREN``), which moves
much less. Prints both and writes JSON (default benchmarks/results/code_sandbox.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from roll_ds.rewards.base import RewardSample
from roll_ds.rewards.code_reward import CodeReward

PROGRAM = "```python\nn = int(input())\nprint(n * n)\n```"


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="programs scored")
    parser.add_argument("--workers", type=int, default=2, help="the code reward's num_workers")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "code_sandbox.json"))
    args = parser.parse_args()
    fn = CodeReward(num_workers=args.workers)
    samples = [
        RewardSample(PROGRAM, json.dumps([{"input": f"{i}\n", "output": f"{i * i}\n"}]))
        for i in range(args.n)
    ]
    try:
        fn.warmup()
        fn(samples[: args.workers])
        cpu_before = _children_cpu_s()
        start = time.perf_counter()
        out = fn(samples)
        elapsed = time.perf_counter() - start
        cpu_s = _children_cpu_s() - cpu_before
    finally:
        fn.close()
    assert out.scores == [1.0] * args.n, [i for i in out.infos if i.get("error_category")][:3]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "commit": commit,
        "programs": args.n,
        "num_workers": args.workers,
        "seconds": round(elapsed, 3),
        "programs_per_s": round(args.n / elapsed, 2),
        "cpu_ms_per_program": round(1000 * cpu_s / args.n, 1),
        "python": fn.sandbox.python,
        "isolation": fn.sandbox.isolation,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(record))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    with open(args.out, "w") as f:
        json.dump(with_host(record), f, indent=1)


if __name__ == "__main__":
    main()
