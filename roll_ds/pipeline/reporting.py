"""What a run reports: phase timings, the step's totals and throughput, the tracker
(metrics.jsonl, TensorBoard, W&B), the curves at the end, the rollout dumps and the progress
bar's figures."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from roll_ds.config.schema import RLVRConfig
from roll_ds.distributed.batch import Batch
from roll_ds.tracking import ROLLOUTS_FILE, Tracker, plot_curves, read_metrics

CURVES = (
    "rollout/score",
    "rollout/accuracy",
    "eval/accuracy",
    "rollout/success",  # agentic: the share of episodes that solved their task
    "eval/success",
    "actor/pg_loss",
    "critic/value_loss",
)
PROGRESS_KEYS = (
    "rollout/score",
    "rollout/success",
    "eval/accuracy",
    "eval/success",
    "actor/pg_loss",
    "time/step",
)


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record the seconds the block takes as ``timings["time/<name>"]``."""
    start = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - start


def add_step_totals(
    metrics: dict[str, float],
    timings: dict[str, float],
    batch: Batch,
    colocation_seconds: float | None = None,
) -> dict[str, float]:
    """``time/*`` of the phases, ``time/step``, ``colocation/seconds`` (the offload / sleep /
    wake calls, inside the phases' times) where given, and the step's end-to-end throughput
    (per second of the whole step: generation may overlap training)."""
    metrics.update(timings)
    metrics["time/step"] = sum(timings.values())
    if colocation_seconds is not None:
        metrics["colocation/seconds"] = colocation_seconds
    step_s = max(metrics["time/step"], 1e-9)
    metrics["throughput/generated_tokens_per_s"] = float(batch["response_mask"].sum()) / step_s
    metrics["throughput/samples_per_s"] = len(batch) / step_s
    return metrics


def open_tracker(
    cfg: RLVRConfig, out_dir: Path, start_step: int, run_id: str | None = None
) -> Tracker:
    """The run's tracker; ``run_id``: the id a resumed run's checkpoint kept (None: a new one)."""
    return Tracker(
        out_dir,
        tensorboard=cfg.tracking.tensorboard,
        jsonl=cfg.tracking.jsonl,
        wandb_project=cfg.tracking.wandb_project,
        run_name=cfg.exp_name,
        config=asdict(cfg),
        resume_step=start_step,
        run_id=run_id,
    )


def plot_run_curves(out_dir: Path) -> list[dict[str, float]]:
    """The run's metrics rows, plotted to ``curves.png``."""
    rows = read_metrics(out_dir / "metrics.jsonl")
    plot_curves(rows, list(CURVES), out_dir / "curves.png")
    return rows


def dump_rollouts(out_dir: Path, step: int, batch: Batch, *, use_critic: bool) -> None:
    """One JSON row per sample: its ``prompt`` (the first observation: a row's prompt, an
    environment's reset observation, text or chat messages), response and score; with a critic
    also its per-response-token ``values``, ``returns`` and ``advantages`` (to inspect what the
    critic learns); for an agentic episode its end status and its turns (the policy's action,
    the observation, the reward)."""
    token_keys = ("values", "returns", "advantages") if use_critic else ()
    mask = batch["response_mask"] > 0
    out_dir.mkdir(parents=True, exist_ok=True)  # also when stepped without run()
    with open(out_dir / ROLLOUTS_FILE, "a") as f:
        for i in range(len(batch)):
            row = {
                "step": step,
                "id": batch["id"][i],
                "domain": batch["domain"][i],
                "prompt": batch["prompt_text"][i] if "prompt_text" in batch.non_tensors else None,
                "response": batch["response_text"][i],
                "score": float(batch["scores"][i]),
            }
            row.update({k: batch[k][i][mask[i]].tolist() for k in token_keys})
            if "turns" in batch.non_tensors:  # agentic: the episode turn by turn
                row["status"] = batch["status"][i]
                row["turns"] = batch["turns"][i]
            f.write(json.dumps(row) + "\n")


def progress_postfix(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's figures."""
    return {k.split("/")[-1]: f"{metrics[k]:.3g}" for k in PROGRESS_KEYS if k in metrics}
