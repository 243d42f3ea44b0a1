#!/usr/bin/env python
"""Rebuild (or check) the embedded reward model shipped in roll_ds/models/embedded_tiny_rm/.

    python scripts/make_embedded_rm.py            # rebuild from the current recipe (~1-2 min)
    python scripts/make_embedded_rm.py --check    # exit 1 if the shipped model is stale

Run it after changing the reward model's recipe (roll_ds/models/embedded_rm.py), the embedded
policy it starts from, or the task generator, and commit the rewritten directory. Its held-out
accuracy is recorded in the directory's roll_ds_recipe.json (``held_out``).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _shipped_model import rebuild_or_check

from roll_ds.models.embedded_rm import (
    DEFAULT_RM_RECIPE,
    SHIPPED_DIR,
    _policy,
    shipped_digest,
    write_shipped,
)


def main() -> int:
    return rebuild_or_check(
        __doc__.splitlines()[0],
        shipped_dir=SHIPPED_DIR,
        current_digest=lambda: DEFAULT_RM_RECIPE.digest(_policy()[1]),
        shipped_digest=shipped_digest,
        write_shipped=write_shipped,
        report=lambda info: "held-out accuracy:\n" + json.dumps(info["held_out"], indent=2),
    )


if __name__ == "__main__":
    sys.exit(main())
