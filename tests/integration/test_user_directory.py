"""From a directory of the user's own, outside the checkout, with nothing but the installed
package: a config of its own names a reward function (``mymod:MyReward``) and an environment
(``mymod:Echo``) by import path from a module in that directory, and they train together for a
step through run.py; the rows come from the shipped data, found through ``${roll_ds_root:}``
although the launch directory is not the project's. (That the default config composes and
validates with its data from any directory is ``tests/unit/config/test_config_paths.py``.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from roll_ds.config.compose import PROJECT_ROOT

pytestmark = pytest.mark.integration

MODULE = '''
from roll_ds.agentic.env import Env, StepResult
from roll_ds.rewards.base import RewardFn


class MyReward(RewardFn):
    """0.25 or 0.75 by the response's length: scores no shipped function gives."""

    def score_one(self, response, ground_truth, prompt):
        return (0.75 if len(response) % 2 else 0.25), {"correct": False}


class Echo(Env):
    def __init__(self, word: str = "hi"):
        self.word = word

    def reset(self, seed):
        return f"Say {self.word}."

    def step(self, action):
        ok = self.word in action
        return StepResult("yes" if ok else "no", reward=float(ok), done=True, info={"success": ok})
'''

CONFIG = """\
defaults:
  - rlvr_mixed_calculator
  - _self_
exp_name: mine
train_env_manager: {num_env_groups: 1, tags: [Echo]}
val_env_manager: {num_env_groups: 2, tags: [Echo]}
replace:
  rewards:  # one role of the user's own scores every row
    mine: {tag_included: [math, reverse], reward_fns: [{name: "mymod:MyReward", weight: 1.0}]}
  custom_envs:
    Echo: {env_type: "mymod:Echo", max_actions_per_traj: 2, max_tokens_per_step: 8,
           env_config: {word: hi}}
"""

TINY = [
    "max_steps=1",
    "eval_steps=0",
    "save_steps=0",
    "rollout_batch_size=2",  # one group of rows, one of Echo episodes
    "num_return_sequences_in_group=2",
    "actor_train.training_args.per_device_train_batch_size=2",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "tracking.tensorboard=false",
    "tracking.dump_rollouts_every=1",
    "export.at_end=false",
]


def test_own_reward_and_environment_train_from_the_user_s_directory(tmp_path: Path):
    home = tmp_path / "project"
    (home / "configs").mkdir(parents=True)
    (home / "mymod.py").write_text(MODULE)
    (home / "configs" / "mine.yaml").write_text(CONFIG)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    assert str(home) not in env.get("PYTHONPATH", "")  # importable as the launch directory
    args = ["--config-dir", "configs", "--config-name", "mine", *TINY]
    result = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "run.py"), *args],
        cwd=home,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = home / "output" / "mine"  # output_dir ./output: the launch directory's
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert "rollout/Echo/success" in rows[0] and rows[0]["env/errors"] == 0
    dumped = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    echo = [d for d in dumped if d["domain"] == "Echo"]
    assert len(echo) == 2 and all(d["status"] == "done" for d in echo)
    assert echo[0]["prompt"] == [{"role": "user", "content": "Say hi."}]  # the first observation
    rows_scored = [d for d in dumped if d["domain"] in ("math", "reverse")]
    assert len(rows_scored) == 2, "no dataset rows: the shipped data was not found"
    assert {d["score"] for d in rows_scored} <= {0.25, 0.75}  # MyReward's scores
    logs = result.stdout + result.stderr  # Hydra logs to stdout
    # the stage in use (stage 1 here: a frozen base kept whole trains the LoRA adapter lower)
    assert re.search(r"actor_train: DeepSpeed ZeRO stage [0-3] on 2 rank\(s\)", logs), logs[-3000:]
