"""The ``code`` domain in the real pipeline (Ray + DeepSpeed ZeRO-3 LoRA + vLLM + a reward actor
running the sandboxed ``code`` reward): rlvr_code_zero3 for 2 steps on the embedded model.

The embedded model never learned Python, so its programs fail (score ~0): this checks the
plumbing (sampling the domain, scoring it in the sandbox inside a Ray actor, held-out eval), not
learning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roll_ds.config.compose import PROJECT_ROOT

pytestmark = pytest.mark.integration

OVERRIDES = [
    "max_steps=2",
    "save_steps=0",
    "eval_steps=2",
    "rollout_batch_size=4",
    "num_return_sequences_in_group=4",
    "actor_train.training_args.per_device_train_batch_size=8",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "validation.data_args.file_name=[examples/qwen_rlvr/data/code_eval.jsonl]",
    "validation.max_prompts=8",
    "tracking.tensorboard=false",
]


def test_code_domain_runs_in_the_pipeline(tmp_path: Path):
    command = [sys.executable, "run.py", "--config-name", "rlvr_code_zero3"]
    result = subprocess.run(
        [*command, f"output_dir={tmp_path}", *OVERRIDES],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "rlvr_code_zero3"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert any("rollout/code/score" in r for r in rows[1:]), rows
    for key in ("eval/code/accuracy", "eval/accuracy"):
        assert key in rows[0] and key in rows[-1], key
    code = [
        json.loads(line)
        for line in (run_dir / "rollouts.jsonl").read_text().splitlines()
        if json.loads(line)["domain"] == "code"
    ]
    assert code and all(0.0 <= r["score"] <= 1.0 for r in code)
