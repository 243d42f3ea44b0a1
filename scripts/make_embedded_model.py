#!/usr/bin/env python
"""Rebuild (or check) the embedded model shipped in roll_ds/models/embedded_tiny_qwen2/.

    python scripts/make_embedded_model.py            # rebuild from the current recipe (~90 s)
    python scripts/make_embedded_model.py --check    # exit 1 if the shipped model is stale

Run it after changing the warm-up recipe, the tiny model's spec or the task generator (anything
that changes ``WarmupRecipe.digest()``), and commit the rewritten directory. The build is
deterministic on one machine but not across machines (float rounding), which is why the result
is shipped rather than built on each machine.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from roll_ds.models.embedded import DEFAULT_RECIPE, SHIPPED_DIR, shipped_digest, write_shipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare recipe digests")
    args = parser.parse_args()
    current, shipped = DEFAULT_RECIPE.digest(), shipped_digest()
    if args.check:
        if shipped != current:
            print(f"stale: {SHIPPED_DIR} is recipe {shipped}, the current recipe is {current}")
            return 1
        print(f"up to date: {SHIPPED_DIR} is recipe {current}")
        return 0
    info = write_shipped()
    print(
        f"wrote {SHIPPED_DIR}: recipe {info['recipe_digest']}, {info['num_parameters']} "
        f"parameters, {info['warmup']['steps']} warm-up steps, held-out greedy accuracy "
        f"{info['warmup_eval_accuracy']}, built in {info['build_seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
