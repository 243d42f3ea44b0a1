"""The shipped GSM8K-format sample through run.py from its config alone: parquet rows read by
`datasets`, "#### N" answers, ChatML prompts with a system prompt, and the reward roles and
domain mix `replace:`d in a config derived from rlvr_lora_zero3 (Ray + DeepSpeed ZeRO-3 LoRA +
vLLM + a math_rule reward actor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _pipeline_run import served_syncs

from roll_ds.config.compose import PROJECT_ROOT

pytestmark = pytest.mark.integration

TINY = [
    "max_steps=1",
    "save_steps=0",
    "eval_steps=1",
    "rollout_batch_size=4",
    "num_return_sequences_in_group=4",
    "actor_train.training_args.per_device_train_batch_size=8",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "validation.max_prompts=6",
    "tracking.tensorboard=false",
    "export.at_end=false",
]


def test_gsm8k_sample_runs_from_config_alone(tmp_path: Path):
    result = subprocess.run(
        [
            sys.executable,
            "run.py",
            "--config-name",
            "rlvr_gsm8k_sample",
            f"output_dir={tmp_path}",
            *TINY,
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "rlvr_gsm8k_sample"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows[1:]:
        assert 0.0 <= row["rollout/score"] <= 1.0
        assert served_syncs(rows)[row["step"]]["sync/parity_max_abs_diff"] < 1e-4
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    # Only the replaced domain and reward role exist: nothing of the inherited math / reverse.
    assert not any("math" in k or "reverse" in k for r in rows for k in r), rows[-1].keys()
    samples = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert samples and {s["domain"] for s in samples} == {"gsm8k"}
    assert all(s["id"].startswith("gsm8k_sample_train-") for s in samples)
