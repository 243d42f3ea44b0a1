"""The command line the ``make_embedded_*`` scripts share: rebuild a shipped model directory from
its current recipe, or (``--check``) only compare the recipe digests and exit 1 when it is stale."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def rebuild_or_check(
    description: str,
    *,
    shipped_dir: Path,
    current_digest: Callable[[], str],
    shipped_digest: Callable[[], str | None],
    write_shipped: Callable[[], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
) -> int:
    """Parse ``--check``; rebuild with ``write_shipped`` and print ``report(info)``, or compare
    ``current_digest()`` with ``shipped_digest()``. Returns the exit status."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="only compare recipe digests")
    args = parser.parse_args()
    current, shipped = current_digest(), shipped_digest()
    if args.check:
        if shipped != current:
            print(f"stale: {shipped_dir} is recipe {shipped}, the current recipe is {current}")
            return 1
        print(f"up to date: {shipped_dir} is recipe {current}")
        return 0
    info = write_shipped()
    print(
        f"wrote {shipped_dir}: recipe {info['recipe_digest']}, {info['num_parameters']} "
        f"parameters, built in {info['build_seconds']} s; {report(info)}"
    )
    return 0
