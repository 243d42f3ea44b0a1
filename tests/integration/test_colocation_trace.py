"""The colocation choreography on the real pipeline: a 2-step run of the embedded model with
``colocation.offload=always`` (on CPU the offload / sleep / wake calls move nothing, but the vLLM
strategy tracks its sleep state and refuses to generate or receive weights while asleep, so a
wrong order fails the run). The recorded trace must be exactly the designed order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pipeline_run import metrics, run

pytestmark = pytest.mark.integration

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


def test_two_colocated_steps_follow_the_designed_order(tmp_path: Path):
    result = run(
        tmp_path,
        "max_steps=2",
        "save_steps=0",
        "eval_steps=0",
        "export.at_end=false",
        "colocation.offload=always",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    trace_file = tmp_path / "rlvr_lora_zero3" / "colocation_trace.jsonl"
    trace = [tuple(json.loads(line).values()) for line in trace_file.read_text().splitlines()]
    assert trace == START + [(s, *entry) for s in (0, 1) for entry in STEP]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["sync/parity_max_abs_diff"] < 1e-4  # the engine served the synced weights
        assert row["colocation/seconds"] >= 0
