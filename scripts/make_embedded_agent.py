#!/usr/bin/env python
"""Rebuild (or check) the embedded agent model shipped in roll_ds/models/embedded_tiny_agent/.

    python scripts/make_embedded_agent.py            # rebuild from the current recipe (minutes)
    python scripts/make_embedded_agent.py --check    # exit 1 if the shipped model is stale

Run it after changing the agent model's recipe (roll_ds/models/embedded_agent.py), the embedded
policy it starts from, the chat template or the environments (roll_ds/agentic/envs/), and commit
the rewritten directory. Its held-out success per environment (greedy and sampled) is recorded
in the directory's roll_ds_recipe.json (``held_out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from roll_ds.models.embedded_agent import (
    DEFAULT_AGENT_RECIPE,
    SHIPPED_DIR,
    _policy,
    shipped_digest,
    write_shipped,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare recipe digests")
    args = parser.parse_args()
    current, shipped = DEFAULT_AGENT_RECIPE.digest(_policy()[1]), shipped_digest()
    if args.check:
        if shipped != current:
            print(f"stale: {SHIPPED_DIR} is recipe {shipped}, the current recipe is {current}")
            return 1
        print(f"up to date: {SHIPPED_DIR} is recipe {current}")
        return 0
    info = write_shipped()
    print(
        f"wrote {SHIPPED_DIR}: recipe {info['recipe_digest']}, {info['num_parameters']} "
        f"parameters, built in {info['build_seconds']} s; held-out success:\n"
        + json.dumps(info["held_out"], indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
