"""Start the pipeline a validated config describes."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from roll_ds.checkpoint import CheckpointError
from roll_ds.config.schema import RLVRConfig
from roll_ds.data.dataset import DatasetFormatError

logger = logging.getLogger("roll_ds")


def run_pipeline(cfg: RLVRConfig) -> list[dict[str, float]]:
    """Run the pipeline to its end. A trainer rank that fails mid-run restarts it here, the one
    place that does: every role is torn down, started again (placed anew: a node that is gone
    is not used) and the run resumes from its latest checkpoint, up to
    ``fault_tolerance.max_trainer_restarts`` times (``restarts.py``: which failures, and what
    they cost). Ray stays up between attempts."""
    from roll_ds.distributed.ray_init import connect_in_background
    from roll_ds.pipeline.restarts import TrainerRestarts

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    restarts = TrainerRestarts(cfg)
    checkpoints = Path(cfg.output_dir) / cfg.exp_name / "checkpoints"  # RLVRPipeline's
    ray_connection = None
    # Ray starts while the driver builds the pipeline (its imports, tokenizer and tasks).
    connecting = connect_in_background(cfg)
    try:
        while True:
            pipeline = _build(restarts.next_config(checkpoints), restarts)
            started, held = False, {}
            try:
                # inside the try: a start-up that fails (or a Ctrl-C) tears down
                pipeline.start(connection=connecting)
                connecting = None  # a restart finds Ray up
                started = True
                rows = pipeline.run()
                break
            except Exception as exc:
                restarts.on_failure(exc, started=started)  # raises unless restarting
                resources = getattr(pipeline, "resources", None)
                held = resources.needed() if resources is not None else {}
            finally:
                ray_connection = ray_connection or getattr(pipeline, "ray", None)
                pipeline.shutdown()
            _wait_released(held)
    finally:
        if ray_connection is None and connecting is not None:  # bad input, found meanwhile
            ray_connection = _connected(connecting)
        stop_local_ray(ray_connection)
    _summarise(rows, pipeline.out_dir, getattr(pipeline, "exported", None))
    return rows


RELEASE_TIMEOUT_S = 60.0


def _connected(connecting):
    """The background connection once it is done (None if it failed): what to stop."""
    try:
        return connecting.result()
    except Exception:  # its error is not the run's: the run already failed otherwise
        return None


def _wait_released(held: dict[str, float]) -> None:
    """Before a restart places the roles again: Ray frees what the teardown held (killed
    actors, removed placement groups) asynchronously, and a placement checked at once found it
    still taken (an agentic run's restart failed so). Bounded; the placement then decides."""
    from roll_ds.distributed.resource_manager import ResourceManager

    if held and not ResourceManager.wait_free(held, RELEASE_TIMEOUT_S):
        logger.warning("Ray has not freed %s within %g s of the teardown", held, RELEASE_TIMEOUT_S)


def _build(cfg: RLVRConfig, restarts):
    """The pipeline of ``cfg``; bad input (model path, data files, routing) exits with its
    message here, before any Ray actor starts."""
    from roll_ds.pipeline.rlvr import RLVRPipeline

    try:
        return RLVRPipeline(cfg, faults=restarts)
    except (DatasetFormatError, FileNotFoundError, ValueError, CheckpointError) as exc:
        print(f"roll_ds: {exc}", file=sys.stderr)
        sys.exit(2)


def stop_local_ray(connection) -> None:
    """Shut down the Ray this run started (its raylet, object store, idle workers): at once,
    not at interpreter exit, where a Ctrl-C or an exception can leave them running. A Ray
    cluster the run joined (``ray.address``) stays up for its other users. ``connection``: the
    ``RayConnection`` of the run's first start (a restart finds Ray up and started nothing)."""
    from roll_ds.distributed.ray_init import release_background

    if connection is not None and connection.started_local:
        import ray

        ray.shutdown()
    release_background()


def _summarise(rows: list[dict[str, float]], out_dir, exported: os.PathLike | None = None) -> None:
    for key, name in (("eval/accuracy", "accuracy"), ("eval/success", "episode success")):
        evals = [(r["step"], r[key]) for r in rows if key in r]
        if evals:
            (s0, a0), (s1, a1) = evals[0], evals[-1]
            print(
                f"roll_ds: eval {name} {a0:.3f} at step {int(s0)} -> {a1:.3f} at step "
                f"{int(s1)} ({(a1 - a0) * 100:+.1f} points)"
            )
    print(f"roll_ds: metrics, curves.png and checkpoints under {out_dir}")
    if exported is not None:
        adapter = os.path.join(exported, "adapter")
        extra = f"; its LoRA adapter (peft) in {adapter}" if os.path.isdir(adapter) else ""
        print(f"roll_ds: Hugging Face model (transformers, vLLM) in {exported}{extra}")
