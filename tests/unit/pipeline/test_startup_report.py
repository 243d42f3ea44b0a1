"""The start-up profile: phases recorded per process (``roll_ds/timeline.py``), gathered by the
driver into ``startup.json`` (``roll_ds/pipeline/startup_report.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from roll_ds import timeline
from roll_ds.pipeline import startup_report
from roll_ds.pipeline.startup_report import STARTUP_FILE, StartupReport, summary


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    timeline.drain()
    monkeypatch.setattr(startup_report, "_written", False)
    monkeypatch.setattr(timeline, "_recording", True)
    yield
    timeline.drain()


def test_phases_are_recorded_in_order_and_drained_once():
    with timeline.phase("second"):
        pass
    timeline.record("first", 1.0, 2.0)
    with pytest.raises(RuntimeError), timeline.phase("failed"):
        raise RuntimeError("a failed start still shows where it stopped")
    names = [p["name"] for p in timeline.drain()]
    assert names == ["first", "second", "failed"]
    assert timeline.drain() == []


def test_a_process_s_start_is_read_to_the_tick_not_the_second():
    """psutil's create_time is boot time (whole seconds) + age: up to 1 s early."""
    before = time.time()
    code = "from roll_ds import timeline; print(timeline.process_started())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    started = float(out.stdout)
    assert before - 0.05 <= started <= time.time()


def test_ranks_phases_are_relative_to_the_launch_and_boot_starts_when_asked(tmp_path):
    report = StartupReport()
    t0 = report.origin
    timeline.record("ray.init", t0 + 1.0, t0 + 3.0)
    report.role_asked("actor_train", t0 + 4.0)
    # a worker process Ray started at t0 + 2 and handed over at the ask: its boot is from 4
    started = [{"pid": 7, "timeline": [{"name": "boot", "start": t0 + 2.0, "end": t0 + 5.0}]}]
    report.add_ranks("actor_train", started)
    initialized = [
        {
            "rank": 0,
            "libraries": ["torch"],
            "timeline": [{"name": "initialize", "start": t0 + 6.0, "end": t0 + 9.0}],
        }
    ]
    report.add_ranks("actor_train", initialized)
    report.add_ranks("rewards.math", None)  # a role whose answers carry no profile
    out = report.write(tmp_path, end=t0 + 10.0)
    assert out == json.loads((tmp_path / STARTUP_FILE).read_text())
    assert out["launch_to_first_step_s"] == pytest.approx(10.0)
    assert out["driver"] == [{"name": "ray.init", "start": 1.0, "end": 3.0}]
    (rank,) = out["roles"]["actor_train"]
    assert rank["pid"] == 7 and rank["libraries"] == ["torch"]
    assert [(p["name"], p["start"], p["end"]) for p in rank["phases"]] == [
        ("boot", 4.0, 5.0),
        ("initialize", 6.0, 9.0),
    ]
    assert "rewards.math" not in out["roles"]
    line = summary(out)
    assert "10.0 s after the launch" in line and "ray.init 2.0" in line
    assert "actor_train[0]: boot 1.0, initialize 3.0" in line
    # once per process: a restarted attempt does not overwrite the launch's profile
    assert report.write(tmp_path, end=t0 + 99.0) is None
    assert json.loads((tmp_path / STARTUP_FILE).read_text())["launch_to_first_step_s"] == 10.0
    with timeline.phase("step 2"):  # the start-up is reported: later phases are not kept
        pass
    assert timeline.drain() == []
