"""scripts/gpu/check.py report: what the GPU check writes to gpu_check.json, from a work folder
laid out as check.sh leaves it (pytest's junit XML, the stages, the runs' outputs), and
docs/benchmarks.md's rendering of it (scripts/docs_benchmarks.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from roll_ds.config.compose import PROJECT_ROOT
from scripts.docs_benchmarks import gpu_check

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


# What check.py runs records of a restarted run (on a GPU: nvidia-smi's processes too).
RESTARTED = {
    "rc": 0,
    "timed_out": False,
    "seconds": 70.2,
    "checkpoint": "step_000002",
    "seconds_to_kill": 30.1,
    "killed": {"pid": 4242, "cmdline": "ray::ActorTrainWorker.train_step"},
    "restart_logged": True,
    "faults": {"faults/restarts": 1.0, "faults/lost_seconds": 21.5},
    "first_restarted_step": 3,
    "processes_in_tree": 19,
    "outlived_run": [],
    "gpu_processes_restarted": [{"pid": 5000, "used": "900 MiB"}],
    "killed_rank_on_gpu": False,
    "gpu_processes_after": [],
}


def _work(tmp_path: Path, runs: dict) -> Path:
    """A work folder as check.sh leaves it: a 4-step straight run, the resumed one differing at
    step 4, the restarted one at step 3, each after a checkpoint at step 2."""
    work = tmp_path / "work"
    exp = "rlvr_lora_zero3"
    work.mkdir()
    (work / "pytest.xml").write_text(JUNIT)
    (work / "stages.txt").write_text("install 0 12\nruns 0 140\npytest 1 200\n")
    (work / "runs.json").write_text(json.dumps(runs))
    straight = [
        {
            "step": s,
            "time/train": 0.5 + s,
            "rollout/score": s / 10,
            "sync/parity_max_abs_diff": 0,
            "colocation/actor_train_offload_allocated_mib": 10.0 + s,
            "perf/mfu": 0.1,
        }
        for s in (1, 2, 3, 4)
    ]
    straight[3]["eval/accuracy"] = 0.25
    resumed = [dict(r) for r in straight]
    resumed[2]["time/train"] = 9.0  # wall clock: not compared
    resumed[2]["perf/mfu"] = 0.2  # nor what derives from it
    resumed[3]["rollout/score"] = 0.41  # step 4 differs
    restarted = [dict(r) for r in straight]
    restarted[2]["rollout/score"] = 0.35  # step 3 differs
    for row in restarted[2:]:  # logged by the attempt after the restart alone
        row |= {"faults/restarts": 1.0, "faults/lost_seconds": 21.5}
    _rows(work / "runs" / "straight" / exp / "metrics.jsonl", straight)
    _rows(work / "runs" / "resume" / exp / "metrics.jsonl", resumed)
    _rows(work / "runs" / "restarted" / exp / "metrics.jsonl", restarted)
    _rows(
        work / "runs" / "straight" / exp / "colocation_trace.jsonl",
        [
            {"step": 0, "role": "actor_train", "action": "offload", "memory_mib": {"a": 1.0}},
            {"step": 0, "role": "pipeline", "action": "train"},
        ],
    )
    return work


def _report(tmp_path: Path, work: Path) -> dict:
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, "scripts/gpu/check.py", "report", str(work), str(out)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def test_report_counts_tests_and_compares_the_resumed_and_restarted_runs(tmp_path: Path):
    runs = {
        "steps": 4,
        "straight": {"rc": 0, "seconds": 50.0},
        "restarted": RESTARTED,
        "killed": {"checkpoint": "step_000002"},
    }
    report = _report(tmp_path, _work(tmp_path, runs))
    pytest_part = report["pytest"]
    assert (pytest_part["passed"], pytest_part["failed"], pytest_part["skipped"]) == (1, 1, 2)
    assert pytest_part["failures"][0]["test"] == "tests.a::test_bad"
    assert pytest_part["skip_reasons"] == {"needs vLLM": 2}
    assert [s["stage"] for s in report["stages"]] == ["install", "runs", "pytest"]
    rlvr = report["rlvr"]
    assert [r["time/train"] for r in rlvr["phase_seconds"]] == [1.5, 2.5, 3.5, 4.5]
    assert rlvr["memory_mib_per_step"][2] == {
        "step": 3,
        "colocation/actor_train_offload_allocated_mib": 13.0,
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
    assert "perf/mfu" not in resume["max_abs_diff_per_metric"]
    restart = rlvr["restart"]
    assert restart["checkpoint"] == "step_000002" and restart["compared_steps"] == [3, 4]
    assert restart["beyond_tolerance"] == [
        {"step": 3, "metric": "rollout/score", "resumed": 0.35, "straight": 0.3}
    ]
    assert restart["max_abs_diff_per_metric"]["rollout/score"] == pytest.approx(0.05)
    assert not any(k.startswith("faults/") for k in restart["max_abs_diff_per_metric"])
    # A run whose stage never started (the budget spent) is reported as skipped.
    assert rlvr["runs"]["resumed"] == {"skipped": "its stage did not start: no time left"}


def _rendered(report: dict) -> str:
    report["versions"] = {
        "gpu": {"name": "NVIDIA H200", "memory_gib": 139.8},
        "packages": {"torch": "2.11.0", "deepspeed": "0.19.8", "ray": "2.60.0"},
    }
    return gpu_check(report)


def test_the_docs_render_the_restarted_run_and_the_skipped_pair(tmp_path: Path):
    skipped = "20 s left of the check's budget; this run takes about 92 s"
    runs = {
        "steps": 4,
        "overrides": ["num_gpus_per_node=1"],
        "straight": {"rc": 0, "seconds": 50.0},
        "restarted": RESTARTED,
        "killed": {"skipped": skipped},
        "resumed": {"skipped": "the killed run skipped"},
    }
    text = _rendered(_report(tmp_path, _work(tmp_path, runs)))
    assert "automatic restart 1 logged, exit 0 after 70.2 s" in text
    assert "faults/lost_seconds 21.5; 0 of 19 processes outlived the run" in text
    assert "on the GPU once restarted 1 processes, the dead rank not among them" in text
    assert "Restarted against uninterrupted, steps 3-4: largest difference over 2" in text
    assert f"Killed by hand and resumed: not checked ({skipped})." in text


def test_the_docs_render_a_report_from_before_the_restarted_run(tmp_path: Path):
    """gpu_check_h200.json recorded before check.py had the restarted run still renders."""
    runs = {
        "steps": 4,
        "overrides": ["num_gpus_per_node=1"],
        "straight": {"rc": 0, "seconds": 50.0},
        "killed": {
            "checkpoint": "step_000002",
            "seconds_to_kill": 30.0,
            "processes_in_tree": 12,
            "outlived_kill": [],
        },
        "resumed": {"rc": 0, "seconds": 31.0},
    }
    work = _work(tmp_path, runs)
    report = _report(tmp_path, work)
    del report["rlvr"]["runs"]["restarted"]  # filled in as skipped by the new report
    text = _rendered(report)
    assert "restart" not in text.replace("resume", "")
    assert "resumed by hand in 31 s" in text
    assert "Resumed against uninterrupted, steps 3-4: largest difference over 2" in text


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


def test_runs_that_would_end_past_the_deadline_are_skipped_with_the_reason(tmp_path: Path):
    """check.py runs estimates a run's time from the straight run's (its RUNS factor) and starts
    none that would end after --deadline; the by-hand resume goes with the killed run."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "runs.json").write_text(json.dumps({"straight": {"rc": 0, "seconds": 100.0}}))
    past = "0"  # the deadline, long past
    cmd = [
        "scripts/gpu/check.py",
        "runs",
        str(work),
        "--only",
        "killed,resumed",
        "--deadline",
        past,
    ]
    result = subprocess.run(
        [sys.executable, *cmd],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr  # skipped for time is no failure
    runs = json.loads((work / "runs.json").read_text())
    assert runs["straight"] == {"rc": 0, "seconds": 100.0}  # kept from the earlier call
    assert (
        "this run takes about 80 s (0.8 x the straight run's 100.0 s)" in runs["killed"]["skipped"]
    )
    assert runs["resumed"] == {"skipped": "the killed run skipped"}
    assert not (work / "run_killed.log").exists()


def test_runs_rejects_an_unknown_run(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "scripts/gpu/check.py", "runs", str(tmp_path), "--only", "straigt"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--only: no run ['straigt']; the runs are straight, restarted, killed, resumed" in (
        result.stderr
    )
