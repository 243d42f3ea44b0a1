"""What the embedded models' recipes share: the recipe digest recorded beside a shipped model,
the policy the reward and agent models start from, and the atomic rewrite of a shipped
directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from roll_ds.config.schema import EMBEDDED_MODEL
from roll_ds.models.shipped import RECIPE_FILE, resolve_embedded


def shipped_digest(shipped_dir: str) -> str | None:
    """The recipe digest a shipped model was built from (None when it is absent)."""
    try:
        with open(os.path.join(shipped_dir, RECIPE_FILE), encoding="utf-8") as f:
            return json.load(f)["recipe_digest"]
    except FileNotFoundError:
        return None


def policy_model() -> tuple[str, str | None]:
    """The shipped embedded policy's directory and the recipe digest it was built from (what
    the embedded reward and agent models start from, and hash into their own digests)."""
    path = resolve_embedded(EMBEDDED_MODEL)
    return path, shipped_digest(path)


def write_info(out_dir: str, info: dict) -> None:
    """``RECIPE_FILE``: what a build records beside the model (its ``recipe_digest`` above all)."""
    with open(os.path.join(out_dir, RECIPE_FILE), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Build with ``n`` CPU threads (the recipe's: the float results depend on it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_shipped(shipped_dir: str, recipe: Any, build: Callable[[str, Any], dict]) -> dict:
    """Build ``recipe`` with ``build(dir, recipe)`` into a temporary sibling of ``shipped_dir``
    and put it in its place: a failed build leaves the old directory as it was."""
    parent = os.path.dirname(shipped_dir)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(shipped_dir)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        info = build(tmp, recipe)
        for name in os.listdir(tmp):  # some writers create private files; these get committed
            os.chmod(os.path.join(tmp, name), 0o644)
        old = shipped_dir + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(shipped_dir):
            os.rename(shipped_dir, old)
        os.rename(tmp, shipped_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info
