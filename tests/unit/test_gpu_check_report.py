"""scripts/gpu/check.py report: what the GPU check writes to gpu_check.json, from a work folder
laid out as check.sh leaves it (pytest's junit XML, the stages, the three runs' outputs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from roll_ds.config.compose import PROJECT_ROOT

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" time="12.5">
<testcase classname="tests.a" name="test_ok" time="1"/>
<testcase classname="tests.a" name="test_bad" time="1"><failure message="AssertionError: 3 != 4">
trace</failure></testcase>
<testcase classname="tests.b" name="test_vllm_1" time="0"><skipped message="needs vLLM"/></testcase>
<testcase classname="tests.b" name="test_vllm_2" time="0"><skipped message="needs vLLM"/></testcase>
</testsuite></testsuites>
"""


def _rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_counts_tests_and_compares_the_resumed_run(tmp_path: Path):
    work = tmp_path / "work"
    exp = "rlvr_lora_zero3"
    work.mkdir()
    (work / "pytest.xml").write_text(JUNIT)
    (work / "stages.txt").write_text("install 0 12\nruns 0 140\npytest 1 200\n")
    (work / "runs.json").write_text(json.dumps({"killed": {"checkpoint": "step_000002"}}))
    straight = [
        {"step": s, "time/train": 0.5 + s, "rollout/score": s / 10, "sync/parity_max_abs_diff": 0}
        for s in (1, 2, 3, 4)
    ]
    straight[2]["colocation/actor_train_offload_allocated_mib"] = 12.0
    resumed = [dict(r) for r in straight]
    resumed[2]["time/train"] = 9.0  # wall clock: not compared
    resumed[3]["rollout/score"] = 0.41  # step 4 differs
    _rows(work / "runs" / "straight" / exp / "metrics.jsonl", straight)
    _rows(work / "runs" / "resume" / exp / "metrics.jsonl", resumed)
    _rows(
        work / "runs" / "straight" / exp / "colocation_trace.jsonl",
        [
            {"step": 0, "role": "actor_train", "action": "offload", "memory_mib": {"a": 1.0}},
            {"step": 0, "role": "pipeline", "action": "train"},
        ],
    )
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, "scripts/gpu/check.py", "report", str(work), str(out)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    pytest_part = report["pytest"]
    assert (pytest_part["passed"], pytest_part["failed"], pytest_part["skipped"]) == (1, 1, 2)
    assert pytest_part["failures"][0]["test"] == "tests.a::test_bad"
    assert pytest_part["skip_reasons"] == {"needs vLLM": 2}
    assert [s["stage"] for s in report["stages"]] == ["install", "runs", "pytest"]
    rlvr = report["rlvr"]
    assert [r["time/train"] for r in rlvr["phase_seconds"]] == [1.5, 2.5, 3.5, 4.5]
    assert rlvr["memory_mib_per_step"][2] == {
        "step": 3,
        "colocation/actor_train_offload_allocated_mib": 12.0,
    }
    assert rlvr["memory_mib_trace"] == [
        {"step": 0, "role": "actor_train", "action": "offload", "memory_mib": {"a": 1.0}}
    ]
    resume = rlvr["resume"]
    assert resume["checkpoint"] == "step_000002" and resume["compared_steps"] == [3, 4]
    assert resume["beyond_tolerance"] == [
        {"step": 4, "metric": "rollout/score", "resumed": 0.41, "straight": 0.4}
    ]
    assert "time/train" not in resume["max_abs_diff_per_metric"]


def test_report_comes_out_when_nothing_ran(tmp_path: Path):
    out = tmp_path / "gpu_check.json"
    subprocess.run(
        [sys.executable, "scripts/gpu/check.py", "report", str(tmp_path / "w"), str(out)],
        cwd=PROJECT_ROOT,
        check=True,
        capture_output=True,
    )
    report = json.loads(out.read_text())
    assert report["pytest"] == {"error": "no pytest.xml (pytest did not finish?)"}
    assert report["stages"] == [] and report["versions"] is None
