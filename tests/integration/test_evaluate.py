"""Evaluation users can trust: ``python -m roll_ds.evaluate`` on a run's best checkpoint reports
the numbers the run itself logged for those weights.

A 2-step run of the embedded default (LoRA, ZeRO-3) evaluates at steps 0 and 2 with k=4 samples
per prompt and keeps its best checkpoint by ``eval/accuracy``. The evaluator then converts
``checkpoints/best`` into a Hugging Face directory (``roll_ds.export``, no DeepSpeed engine),
serves it with only the rollout and reward roles and must report the step-2 metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from _pipeline_run import SMALL, metrics, run

from roll_ds.config.compose import PROJECT_ROOT

pytestmark = pytest.mark.integration

EVAL = [
    "max_steps=2",
    "eval_steps=2",
    "validation.max_prompts=16",
    "validation.num_samples=4",
    "validation.sample_temperature=1.0",
    "save_best=eval/accuracy",
    "keep_last=1",
    "export.at_end=false",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate")
    started = time.perf_counter()
    done = run(out, *EVAL)
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"\n2-step run: {time.perf_counter() - started:.1f} s")
    return out


def test_best_checkpoint_is_kept_with_its_record(trained):
    ckpts = trained / "rlvr_lora_zero3" / "checkpoints"
    record = json.loads((ckpts / "best" / "best.json").read_text())
    step2 = next(r for r in metrics(trained) if r["step"] == 2)
    assert record["step"] == 2 and record["metric"] == "eval/accuracy"
    assert record["value"] == step2["eval/accuracy"]
    for key in ("eval/mean@4", "eval/pass@4", "eval/math/pass@2", "eval/response_length/p90"):
        assert key in step2, key


def test_evaluate_cli_reports_the_runs_own_metrics(trained):
    run_dir = trained / "rlvr_lora_zero3"
    cmd = [
        sys.executable,
        "-m",
        "roll_ds.evaluate",
        "--config-name",
        "rlvr_lora_zero3",
        f"output_dir={trained}",
        *SMALL,
        *EVAL,
        f"checkpoint={run_dir / 'checkpoints' / 'best'}",
    ]
    started = time.perf_counter()
    done = subprocess.run(
        cmd,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    print(f"\nevaluate: {time.perf_counter() - started:.1f} s")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "pass@4" in done.stdout and "response length" in done.stdout  # the printed table
    result = json.loads((run_dir / "eval" / "checkpoints_best.json").read_text())
    assert result["num_prompts"] == 16
    got = result["metrics"]
    step2 = next(r for r in metrics(trained) if r["step"] == 2)
    # the run's evaluation synced the trainer's weights first (eval/sync/*): not a metric of
    # the weights, and the CLI has nothing to sync
    want = {
        k: v for k, v in step2.items() if k.startswith("eval/") and not k.startswith("eval/sync/")
    }
    assert got.keys() == want.keys()
    # The greedy answers of the same weights are the same (the first 16 rows are math).
    for key in ("eval/accuracy", "eval/math/accuracy", "eval/response_length/mean"):
        assert got[key] == want[key], key
    # Samples: the same seeds, weights equal to ~1e-6 (merged in another order); measured equal.
    assert got == pytest.approx(want, abs=0.07)
    assert not list((run_dir / "eval").glob(".converted_*")), "the temporary model is left"
