"""The colocation choreography on the real pipeline: a 2-step run of the embedded model with
``colocation.offload=always`` (on CPU the offload / sleep / wake calls move nothing, but the vLLM
and hf_infer strategies track their sleep state and refuse to generate or receive weights while
asleep, so a wrong order fails the run). The recorded trace must be exactly the designed order,
with vLLM and with hf_infer (the GPU check's rollout engine, scripts/gpu/check.sh) alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pipeline_run import metrics, run, served_syncs

from roll_ds.config.compose import PROJECT_ROOT

pytestmark = pytest.mark.integration

# scripts/gpu/check.sh's run: hf_infer rollouts and one trainer rank, colocated on device 0
GPU_CHECK = [
    line.strip()
    for line in (PROJECT_ROOT / "scripts" / "gpu" / "run_overrides.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

START = [
    (None, "actor_infer", "start"),
    (None, "rewards.math", "start"),
    (None, "rewards.reverse", "start"),
    (None, "actor_infer", "sleep"),  # vLLM profiled an idle device; now the trainer may load
    (None, "actor_train", "start"),
]
STEP = [
    ("pipeline", "sync"),
    ("actor_infer", "wake_weights"),  # weights only: the KV cache waits for the trainer to go
    ("actor_infer", "synced"),
    ("pipeline", "generate"),  # the parity probe's engine half, then the rollouts
    ("actor_train", "offload"),
    ("actor_infer", "wake_kv_cache"),
    ("pipeline", "train"),  # log-probs and training
    ("actor_infer", "sleep"),
    ("actor_train", "reload"),
]


def two_colocated_steps(out_dir: Path, *extra: str) -> list[dict]:
    """Two steps with every model role managed; asserts the trace, returns the metrics."""
    result = run(
        out_dir,
        "max_steps=2",
        "save_steps=0",
        "eval_steps=0",
        "export.at_end=false",
        "colocation.offload=always",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    trace_file = out_dir / "rlvr_lora_zero3" / "colocation_trace.jsonl"
    trace = [tuple(json.loads(line).values()) for line in trace_file.read_text().splitlines()]
    assert trace == START + [(s, *entry) for s in (0, 1) for entry in STEP]
    rows = metrics(out_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # the engine served the synced weights
        assert served_syncs(rows)[row["step"]]["sync/parity_max_abs_diff"] < 1e-4
        assert row["colocation/seconds"] >= 0
    return rows


def test_two_colocated_steps_follow_the_designed_order(tmp_path: Path):
    two_colocated_steps(tmp_path)


def test_hf_infer_rollouts_sleep_in_the_same_order_as_vllm(tmp_path: Path):
    """The GPU check's run on CPU: the weights reach hf_infer through the sync (its log-probs
    score the parity probe), and it sleeps and wakes where vLLM would."""
    assert "actor_infer.strategy_args.strategy_name=hf_infer" in GPU_CHECK
    rows = two_colocated_steps(tmp_path, *GPU_CHECK)
    for row in rows:
        sync = served_syncs(rows)[row["step"]]
        assert sync["sync/bytes"] > 0 and sync["sync/receivers"] == 1
        assert not any(k.endswith("_mib") for k in row)  # memory figures come from GPUs only
