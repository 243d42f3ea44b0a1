"""benchmarks/startup.py: the figures it derives from a run's startup.json and metrics rows (the
subprocess driver aside), and the tables it prints from them."""

from __future__ import annotations

import json

import pytest

from benchmarks.startup import (
    breakdown_table,
    derive,
    metrics_figures,
    read_rows,
    role_breakdown,
    run_table,
)


def _p(name: str, start: float, end: float, **extra) -> dict:
    return {"name": name, "start": start, "end": end, **extra}


# the shape roll_ds/pipeline/startup_report.py writes (cut to two roles)
PROFILE = {
    "launch_to_first_step_s": 30.0,
    "driver_pid": 1,
    "driver": [
        _p("python + imports", 0.0, 1.0),
        _p("ray.init", 2.0, 6.0),
        _p("initialize stage 0", 8.0, 20.0, roles=["actor_train"]),
        _p("initialize stage 1", 20.0, 24.5, roles=["actor_infer"]),
        _p("step-0 evaluation", 24.5, 28.0),
        _p("step 1", 28.0, 30.0),
    ],
    "roles": {
        "actor_train": [
            {
                "rank": 0,
                "pid": 2,
                "phases": [_p("boot", 6.0, 8.0), _p("initialize", 8.0, 19.0)],
                "libraries": ["torch", "deepspeed"],
            },
            {
                "rank": 1,
                "pid": 3,
                "phases": [_p("boot", 6.0, 8.5), _p("initialize", 8.5, 19.5)],
                "libraries": ["torch", "deepspeed", "peft"],
            },
        ],
        "actor_infer": [
            {
                "rank": 0,
                "pid": 4,
                "phases": [_p("boot", 6.0, 7.0), _p("import vllm", 20.0, 22.0)],
                "libraries": ["torch", "vllm"],
            }
        ],
    },
}
ROWS = [
    {"step": 0, "eval/accuracy": 0.12, "eval/math/accuracy": 0.13, "eval/score": 0.12},
    {"step": 1, "time/step": 0.5, "loss": 0.1},
    {"step": 2, "time/step": 0.25, "eval/accuracy": 0.325, "eval/reverse/accuracy": 0.3},
]


def test_figures_of_a_run_from_its_profile_and_metrics():
    run = derive(PROFILE, ROWS, wall_s=40.0, floor_s=6.0, startup_seen_s=30.04)
    assert run["launch_to_first_step_s"] == 30.0
    assert run["ratio_to_import_floor"] == 5.0
    assert run["roles_up_s"] == 24.5  # the end of the last initialize stage
    assert run["startup_seen_s"] == 30.04
    assert run["seen_minus_first_step_s"] == 0.04  # the outside cross-check
    assert (run["steps"], run["steps_s"]) == (2, 0.75)
    assert run["outside_steps_s"] == 39.25  # wall - summed time/step
    assert run["eval_accuracy_by_step"] == {"0": 0.12, "2": 0.325}
    # the last eval row's accuracy keys only (not eval/score, not another row's)
    assert run["final_eval_step"] == 2
    assert run["final_eval_accuracy"] == {"eval/accuracy": 0.325, "eval/reverse/accuracy": 0.3}
    ray_init = next(p for p in run["driver"] if p["name"] == "ray.init")
    assert ray_init["s"] == 4.0
    assert run["driver"][2]["roles"] == ["actor_train"]  # extra fields kept


def test_roles_show_their_slowest_rank_and_every_library_loaded():
    roles = role_breakdown(PROFILE)
    train = roles["actor_train"]
    assert (train["ranks"], train["slowest_rank"]) == (2, 1)
    assert [(p["name"], p["s"]) for p in train["phases"]] == [("boot", 2.5), ("initialize", 11.0)]
    assert train["libraries"] == ["torch", "deepspeed", "peft"]  # the union, in order
    assert roles["actor_infer"]["libraries"] == ["torch", "vllm"]


def test_no_floor_no_initialize_stage_no_metrics_give_blanks_not_errors():
    profile = {**PROFILE, "driver": PROFILE["driver"][:2], "roles": {}}
    run = derive(profile, [], wall_s=10.0, floor_s=None)
    assert run["ratio_to_import_floor"] is None and run["roles_up_s"] is None
    assert run["startup_seen_s"] is None and run["seen_minus_first_step_s"] is None
    assert run["roles"] == {}
    assert metrics_figures([]) == {
        "steps": 0,
        "steps_s": 0,
        "eval_accuracy_by_step": {},
        "final_eval_step": None,
        "final_eval_accuracy": {},
    }
    assert run["outside_steps_s"] == 10.0


def test_tables_print_each_run_and_the_last_runs_phases():
    runs = [
        {"index": i, "extensions": label, **derive(PROFILE, ROWS, wall_s=w, floor_s=6.0)}
        for i, (label, w) in enumerate([("cold", 80.0), ("warm", 40.0)])
    ]
    lines = run_table(runs, 6.0)
    assert lines[0] == "import floor 6.00 s"
    assert lines[2].split() == ["0", "cold", "30.0", "5.00", "24.5", "-", "80.0", "0.75", "79.2"]
    assert lines[3].split()[:2] == ["1", "warm"]
    text = "\n".join(breakdown_table(runs[-1]))
    assert "actor_train[1] of 2: torch, deepspeed, peft" in text
    assert "initialize stage 1" in text and "import vllm" in text


@pytest.mark.parametrize("blank", ["", "\n"])
def test_metrics_rows_read_from_jsonl(tmp_path, blank):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" + blank for r in ROWS))
    assert read_rows(path) == ROWS
    assert read_rows(tmp_path / "absent.jsonl") == []
