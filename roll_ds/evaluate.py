"""Evaluate a trained policy on its run's held-out data, without training it.

    python -m roll_ds.evaluate --config-name rlvr_lora_zero3 \\
        checkpoint=output/rlvr_lora_zero3/hf/step_000040
    python -m roll_ds.evaluate --config-name rlvr_lora_zero3 \\
        checkpoint=output/rlvr_lora_zero3/checkpoints/best validation.num_samples=8

The config is the training run's, composed by Hydra with the same overrides ``run.py`` takes;
``checkpoint=`` names the policy: an exported Hugging Face model directory (``hf/step_NNNNNN``
of a run, or any directory with ``config.json`` and weights) or a roll_ds checkpoint
(``checkpoints/step_NNNNNN``, ``checkpoints/best``, or ``checkpoints`` for the newest), which
``roll_ds.export`` converts into a temporary model directory first (no DeepSpeed engine, no
process group). Only the rollout role (``actor_infer``) and the reward roles start; the
evaluation is the training loop's own (``roll_ds.pipeline.evaluation``), so the numbers equal
the run's ``eval/*`` metrics for the same weights. A table is printed and the metrics are
written as JSON to ``<output_dir>/<exp_name>/eval/<checkpoint>.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from roll_ds.checkpoint import COMPLETE, LATEST
from roll_ds.config.agentic import has_environments
from roll_ds.pipeline.eval_metrics import GREEDY_NAMES, LENGTH_NAMES, PREFIX, SAMPLED

if TYPE_CHECKING:
    from roll_ds.config.schema import RLVRConfig

logger = logging.getLogger("roll_ds.evaluate")

CHECKPOINT_ARG = "checkpoint"
EVAL_DIR = "eval"  # under <output_dir>/<exp_name>/
VALID_CHECKPOINTS = (
    "an exported model directory (output/<exp>/hf/step_NNNNNN, or any Hugging Face model "
    "directory with config.json and *.safetensors weights) or a training checkpoint "
    "(output/<exp>/checkpoints/step_NNNNNN, checkpoints/best, or checkpoints/ for the newest)"
)


class CheckpointArgError(ValueError):
    """``checkpoint=`` is missing or names nothing a policy can be loaded from."""


# --- what checkpoint= names ------------------------------------------------------------------


def split_checkpoint_arg(overrides: Sequence[str]) -> tuple[str, list[str]]:
    """``checkpoint=<path>`` out of the command-line overrides; the rest go to Hydra."""
    found, rest = [], []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") == CHECKPOINT_ARG:
            found.append(value)
        else:
            rest.append(arg)
    if len(found) != 1 or not found[0]:
        what = "is missing" if not found or not found[0] else "is given more than once"
        raise CheckpointArgError(f"checkpoint=<path> {what}; pass {VALID_CHECKPOINTS}")
    return found[0], rest


def checkpoint_kind(path: str | Path) -> str:
    """``"hf"`` for a Hugging Face model directory, ``"checkpoint"`` for a roll_ds checkpoint
    (or a ``checkpoints`` directory); else ``CheckpointArgError`` saying what would do."""
    path = Path(path)
    if not path.exists():
        raise CheckpointArgError(f"checkpoint={path}: no such directory; pass {VALID_CHECKPOINTS}")
    if not path.is_dir():
        raise CheckpointArgError(
            f"checkpoint={path} is a file, not a directory; pass {VALID_CHECKPOINTS}"
        )
    if (path / "config.json").is_file():
        weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
        if not weights:
            raise CheckpointArgError(
                f"checkpoint={path} has config.json but no weights (*.safetensors or "
                f"pytorch_model*.bin); pass {VALID_CHECKPOINTS}"
            )
        return "hf"
    if (path / COMPLETE).is_file() or (path / LATEST).is_file():
        return "checkpoint"
    if (path / "adapter_config.json").is_file():
        raise CheckpointArgError(
            f"checkpoint={path} is a peft adapter without its base; pass the merged model "
            f"directory the export wrote beside it ({path.parent}) or the training checkpoint"
        )
    exported = sorted(p.name for p in path.glob("step_*") if (p / "config.json").is_file())
    hint = f" (it holds exported models: pass one, e.g. {path / exported[-1]})" if exported else ""
    raise CheckpointArgError(
        f"checkpoint={path} is neither a Hugging Face model directory (no config.json) nor a "
        f"complete roll_ds checkpoint (no {COMPLETE} marker){hint}; pass {VALID_CHECKPOINTS}"
    )


@contextlib.contextmanager
def policy_model_dir(checkpoint: str | Path, work_dir: Path) -> Iterator[Path]:
    """A Hugging Face model directory of the policy ``checkpoint`` names: itself, or its
    conversion into a temporary directory under ``work_dir`` (deleted afterwards)."""
    if checkpoint_kind(checkpoint) == "hf":
        yield Path(checkpoint)
        return
    from roll_ds.export import convert_checkpoint

    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".converted_", dir=work_dir) as tmp:
        out = Path(tmp) / "model"
        started = time.perf_counter()
        convert_checkpoint(checkpoint, out)
        logger.info("converted %s to %s in %.1f s", checkpoint, out, time.perf_counter() - started)
        yield out


def result_name(checkpoint: str | Path) -> str:
    """A file name for the result of ``checkpoint``: its directory and its parent's
    (``hf_step_000040``, ``checkpoints_best``)."""
    path = Path(checkpoint)
    name = f"{path.parent.name}_{path.name}" if path.parent.name else path.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"


# --- running it -----------------------------------------------------------------------------


def eval_config(cfg: RLVRConfig, model_dir: str | Path) -> RLVRConfig:
    """``cfg`` with the policy at ``model_dir`` as the model the rollout role serves."""
    infer = cfg.actor_infer
    return replace(
        cfg,
        pretrain=str(model_dir),
        resume_from_checkpoint=None,
        actor_infer=replace(infer, model_args=replace(infer.model_args, model_name_or_path=None)),
    )


def evaluate_model(cfg: RLVRConfig, model_dir: str | Path) -> tuple[dict[str, float], int]:
    """Start the rollout and reward roles on the model at ``model_dir`` and evaluate it as the
    training loop does; returns the metrics and the number of held-out prompts."""
    from roll_ds.pipeline.launch import stop_local_ray
    from roll_ds.pipeline.rlvr import RLVRPipeline

    # data and environments read exactly as training reads them
    pipeline = RLVRPipeline(eval_config(cfg, model_dir))
    try:
        pipeline.start(eval_only=True)
        metrics = {k: v for k, v in pipeline.evaluate().items() if not k.startswith("eval/sync/")}
        episodes = 0
        if cfg.val_env_manager.tags:
            episodes = cfg.val_env_manager.num_env_groups * cfg.val_env_manager.group_size
        return metrics, len(pipeline.tasks.eval_rows) + episodes
    finally:
        pipeline.shutdown()
        stop_local_ray(getattr(pipeline, "ray", None))  # a Ray it joined stays up


# --- the report ------------------------------------------------------------------------------


def table_rows(metrics: Mapping[str, float]) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the accuracy table: one row overall (``all``) and one per domain;
    columns: the greedy metrics, then ``mean@k`` and ``pass@k`` in order of k."""

    def order(name: str) -> tuple[int, int]:
        if name in GREEDY_NAMES:
            return (0, GREEDY_NAMES.index(name))
        kind, _, k = name.partition("@")
        return (1 if kind == "mean" else 2, int(k))

    names = [k.split("/", 1)[1] for k in metrics if k.count("/") == 1 and k.startswith(PREFIX)]
    columns = sorted((n for n in names if n in GREEDY_NAMES or "@" in n), key=order)
    domains = sorted(
        {k.split("/")[1] for k in metrics if k.count("/") == 2 and k.split("/")[2] in columns}
    )
    rows = []
    for domain in ["all", *domains]:
        tag = PREFIX if domain == "all" else f"{PREFIX}/{domain}"
        rows.append([domain] + [_fmt(metrics.get(f"{tag}/{c}")) for c in columns])
    return columns, rows


def length_rows(metrics: Mapping[str, float]) -> list[list[str]]:
    """Rows (greedy, sampled) of the response-length table, columns as ``LENGTH_NAMES``."""
    rows = []
    for label, tag in (("greedy", PREFIX), ("sampled", f"{PREFIX}/{SAMPLED}")):
        if f"{tag}/{LENGTH_NAMES[0]}" in metrics:
            rows.append([label] + [_fmt(metrics.get(f"{tag}/{n}")) for n in LENGTH_NAMES])
    return rows


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


AGENTIC_COLUMNS = ("success", "turns_per_episode", "tool_calls", "tool_errors", "format_errors")


def print_report(metrics: Mapping[str, float], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    if f"{PREFIX}/success" in metrics:  # agentic: held-out episodes per environment tag
        table = Table(title=title.replace("prompts", "episodes"))
        for name in ["environment", *AGENTIC_COLUMNS]:
            table.add_column(name, justify="left" if name == "environment" else "right")
        table.add_row("all", *[_fmt(metrics.get(f"{PREFIX}/{c}")) for c in AGENTIC_COLUMNS])
        tags = sorted(
            {k.split("/")[1] for k in metrics if k.count("/") == 2 and k.endswith("/success")}
        )
        for tag in tags:
            table.add_row(tag, _fmt(metrics[f"{PREFIX}/{tag}/success"]), *["-"] * 4)
        Console().print(table)
        return

    columns, rows = table_rows(metrics)
    table = Table(title=title)
    for name in ["domain", *columns]:
        table.add_column(name, justify="left" if name == "domain" else "right")
    for row in rows:
        table.add_row(*row)
    lengths = Table(title="response length (tokens)")
    for name in ["", "mean", "p50", "p90", "max", "truncated"]:
        lengths.add_column(name, justify="left" if not name else "right")
    for row in length_rows(metrics):
        lengths.add_row(*row)
    console = Console()
    console.print(table)
    console.print(lengths)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m roll_ds.evaluate",
        description="Evaluate an exported model or a checkpoint on the held-out data of a run's "
        "config (the rollout and reward roles only); prints a table, writes JSON.",
    )
    parser.add_argument(
        "--config-name", required=True, help="the training config, e.g. rlvr_lora_zero3"
    )
    parser.add_argument(
        "--config-dir", default=None, help="its directory (default examples/qwen_rlvr)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="JSON file (default <output_dir>/<exp_name>/eval/<checkpoint>.json)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="checkpoint=<path> and Hydra overrides as for run.py"
    )
    args = parser.parse_args(argv)
    try:
        checkpoint, overrides = split_checkpoint_arg(args.overrides)
        cfg = _load_config(args.config_name, overrides, args.config_dir)
        if not cfg.validation.data_args.file_name and not has_environments(cfg):
            raise ValueError(
                "validation.data_args.file_name: empty; list the held-out data files to "
                "evaluate on (as for eval_steps in training)"
            )
        checkpoint_kind(checkpoint)  # a bad path fails before anything starts
    except (CheckpointArgError, ValueError) as exc:
        print(f"roll_ds.evaluate: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run_dir = Path(cfg.output_dir) / cfg.exp_name
    started = time.perf_counter()
    try:
        with policy_model_dir(checkpoint, run_dir / EVAL_DIR) as model_dir:
            metrics, num_prompts = evaluate_model(cfg, model_dir)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"roll_ds.evaluate: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / EVAL_DIR / f"{result_name(checkpoint)}.json"
    result = {
        "checkpoint": str(Path(checkpoint).resolve()),
        "config_name": args.config_name,
        "overrides": overrides,
        "num_prompts": num_prompts,
        "seconds": round(time.perf_counter() - started, 2),
        "metrics": dict(sorted(metrics.items())),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_report(metrics, f"{result_name(checkpoint)}: {num_prompts} held-out prompts")
    print(f"roll_ds.evaluate: metrics written to {out}")
    return 0


def _load_config(name: str, overrides: list[str], config_dir: str | None) -> RLVRConfig:
    """Compose and validate like run.py. Validation raises ``ConfigError`` (a ValueError listing
    every problem); Hydra's errors become ValueErrors with roll_ds's hint for the override."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from roll_ds.config import to_schema, validate
    from roll_ds.config.compose import compose_config
    from roll_ds.config.hints import hint_for_exception

    try:
        cfg = to_schema(compose_config(name, overrides, config_dir))
        validate(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        hint = hint_for_exception(exc, config_name=name, config_dir=config_dir, overrides=overrides)
        raise ValueError(f"{exc}" + (f"\nroll_ds hint: {hint}" if hint else "")) from None
    return cfg


if __name__ == "__main__":
    sys.exit(main())
