"""Start the pipeline a validated config describes."""

from __future__ import annotations

import logging
import os
import sys

from roll_ds.config.schema import RLVRConfig
from roll_ds.data.dataset import DatasetFormatError

logger = logging.getLogger("roll_ds")


def run_pipeline(cfg: RLVRConfig) -> list[dict[str, float]]:
    from roll_ds.pipeline.rlvr import RLVRPipeline

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        # Everything that reads user input (model path, data files, routing) fails here,
        # before any Ray actor starts.
        pipeline = RLVRPipeline(cfg)
    except (DatasetFormatError, FileNotFoundError, ValueError) as exc:
        print(f"roll_ds: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        pipeline.start()  # inside the try: a start-up that fails (or a Ctrl-C) still tears down
        rows = pipeline.run()
    finally:
        pipeline.shutdown()
        stop_local_ray(pipeline)
    _summarise(rows, pipeline.out_dir, getattr(pipeline, "exported", None))
    return rows


def stop_local_ray(pipeline) -> None:
    """Shut down the Ray this run started (its raylet, object store, idle workers): at once,
    not at interpreter exit, where a Ctrl-C or an exception can leave them running. A Ray
    cluster the run joined (``ray.address``) stays up for its other users."""
    connection = getattr(pipeline, "ray", None)
    if connection is not None and connection.started_local:
        import ray

        ray.shutdown()


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
