#!/usr/bin/env python
"""Rebuild (or check) an embedded model shipped in roll_ds/models/, from its recipe in
examples/embedded_models/.

    python scripts/make_embedded.py --model policy           # embedded:tiny-qwen2 (~90 s)
    python scripts/make_embedded.py --model rm               # embedded:tiny-rm (~1-2 min)
    python scripts/make_embedded.py --model agent            # embedded:tiny-agent (minutes)
    python scripts/make_embedded.py --model policy --check   # exit 1 if the shipped copy is stale

Run it after changing a recipe (or what its digest covers: the tiny model's spec, the task
generator, the environments, the chat template) and commit the rewritten directory. The reward
and agent models start from the shipped policy and hash its digest into theirs: rebuild them
after the policy. A build is deterministic on one machine but not across machines (float
rounding), which is why the result is shipped rather than built on each machine; what the build
measured is recorded in the directory's roll_ds_recipe.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from examples.embedded_models import RECIPES, recipe_module
from examples.embedded_models.common import shipped_digest, write_shipped
from roll_ds.models.shipped import shipped_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, choices=sorted(RECIPES))
    parser.add_argument("--check", action="store_true", help="only compare recipe digests")
    args = parser.parse_args(argv)
    recipe = recipe_module(args.model)
    path = shipped_model(recipe.NAME).path
    current, shipped = recipe.current_digest(), shipped_digest(path)
    if args.check:
        if shipped != current:
            print(f"stale: {path} is recipe {shipped}, the current recipe is {current}")
            return 1
        print(f"up to date: {path} is recipe {current}")
        return 0
    info = write_shipped(path, recipe.DEFAULT_RECIPE, recipe.build)
    print(
        f"wrote {path}: recipe {info['recipe_digest']}, {info['num_parameters']} parameters, "
        f"built in {info['build_seconds']} s; {recipe.report(info)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
