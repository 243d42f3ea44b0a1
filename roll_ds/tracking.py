"""Metrics sinks: JSONL (always written), TensorBoard, optional wandb; curves as a PNG."""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"  # sampled responses, one row per sample with its "step"


class Tracker:
    """Fan one ``log(metrics, step)`` call out to the configured sinks."""

    def __init__(
        self,
        log_dir: str | Path,
        *,
        tensorboard: bool = True,
        jsonl: bool = True,
        wandb_project: str | None = None,
        run_name: str = "rlvr",
        config: Mapping[str, Any] | None = None,
        resume_step: int = 0,
        run_id: str | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        # the run's own id (kept in its checkpoints): a resumed run, by hand or after an
        # automatic restart, passes it back and goes on as the same W&B run
        self.run_id = run_id or new_run_id()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = None
        if jsonl:
            path = self.log_dir / METRICS_FILE
            if resume_step:  # drop rows past the checkpoint: the resumed run writes them again
                truncate_jsonl_after(path, resume_step)
            elif path.exists():  # a fresh run replaces an earlier run's rows, never mixes in
                path.unlink()
            self._jsonl = open(path, "a")  # noqa: SIM115  (closed in close())
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"), purge_step=resume_step)
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(
                project=wandb_project,
                name=run_name,
                config=dict(config or {}),
                id=self.run_id,
                resume="allow",
                dir=str(self.log_dir),  # W&B's own files with the run's, not in the launch dir
            )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            self._wandb = None
            # finish() leaves W&B's service (wandb-core, a child process) running until this
            # process exits: a pipeline shut down in a process that goes on (tests, benchmarks)
            # would leave it behind
            wandb.teardown()


def new_run_id() -> str:
    """A fresh run id (W&B's form: 8 lowercase letters and digits)."""
    return uuid.uuid4().hex[:8]


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(rows: list[dict[str, float]], keys: list[str], out_png: str | Path) -> Path | None:
    """One panel per key present in ``rows`` (x: step); returns the PNG path, None if no data.
    A key ``<group>/<name>`` with per-domain companions ``<group>/<domain>/<name>`` in ``rows``
    (``eval/accuracy`` and ``eval/math/accuracy``, ...) gets them as extra lines in its panel."""
    present = [k for k in keys if any(k in r for r in rows)]
    if not present:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.4), squeeze=False)
    for ax, key in zip(axes[0], present, strict=True):
        parts = per_domain_keys(rows, key)
        for label, series in [("all", key), *parts.items()]:
            points = [(r["step"], r[series]) for r in rows if series in r]
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                markersize=3,
                label=label,
                linewidth=2.0 if series == key else 1.0,
            )
        if parts:
            ax.legend(fontsize="small")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def per_domain_keys(rows: list[dict[str, float]], key: str) -> dict[str, str]:
    """``{domain: "<group>/<domain>/<name>"}`` for the keys of ``rows`` that break ``key`` =
    ``<group>/<name>`` down by domain (one path level between the two), sorted by domain."""
    group, sep, name = key.partition("/")
    if not sep or "/" in name:
        return {}
    found = {}
    for row in rows:
        for other in row:
            parts = other.split("/")
            if len(parts) == 3 and parts[0] == group and parts[2] == name:
                found[parts[1]] = other
    return dict(sorted(found.items()))


def _is_number(value: Any) -> bool:
    """Numbers (NaN included: a diverging loss must show) but not strings or containers."""
    if isinstance(value, bool):
        return True
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def truncate_jsonl_after(path: str | Path, step: int) -> int:
    """Drop the rows of a JSONL log whose ``"step"`` is past ``step`` (a resumed run writes them
    again) and a last line cut short by a crash; returns how many rows were dropped.

    The kept lines are copied unchanged, streamed into a temporary file that replaces ``path``
    (fsynced first), so a crash here leaves either the old or the new file.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    tmp = path.with_name(path.name + ".tmp")
    dropped = 0
    with open(path, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
        for line in src:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a write cut short by the crash
                dropped += 1
                continue
            if row.get("step", 0) > step:
                dropped += 1
                continue
            dst.write(line if line.endswith("\n") else line + "\n")
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    if dropped:
        logger.info("%s: dropped %d row(s) past step %d", path, dropped, step)
    return dropped
