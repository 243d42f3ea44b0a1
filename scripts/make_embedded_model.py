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

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _shipped_model import rebuild_or_check

from roll_ds.models.embedded import (
    DEFAULT_RECIPE,
    SHIPPED_DIR,
    shipped_digest,
    write_shipped,
)


def main() -> int:
    return rebuild_or_check(
        __doc__.splitlines()[0],
        shipped_dir=SHIPPED_DIR,
        current_digest=lambda: DEFAULT_RECIPE.digest(),
        shipped_digest=shipped_digest,
        write_shipped=write_shipped,
        report=lambda info: (
            f"{info['warmup']['steps']} warm-up steps, held-out greedy accuracy "
            f"{info['warmup_eval_accuracy']}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
