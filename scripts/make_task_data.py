#!/usr/bin/env python
"""Write (or check) the synthetic task files shipped in examples/qwen_rlvr/data/.

    python scripts/make_task_data.py            # regenerate the files
    python scripts/make_task_data.py --check    # exit 1 if a shipped file differs

Re-running reproduces identical bytes: rows come from examples/embedded_models/synthetic.py with
the default TaskSpec (seed 0), which is also what the embedded model's warm-up trains on.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from examples.embedded_models.synthetic import TaskSpec, file_name, generate_all, to_jsonl

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples", "qwen_rlvr", "data"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for (domain, split), rows in generate_all(TaskSpec()).items():
        path = os.path.join(args.out, file_name(domain, split))
        text = to_jsonl(rows)
        if args.check:
            try:
                with open(path, encoding="utf-8", newline="") as f:
                    same = f.read() == text
            except FileNotFoundError:
                same = False
            if not same:
                stale.append(path)
            continue
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        print(f"wrote {len(rows):5d} rows  {len(text.encode()):7d} bytes  {os.path.normpath(path)}")
    if stale:
        print("out of date (run scripts/make_task_data.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
