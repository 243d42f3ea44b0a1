"""The embedded reward model's recipe (examples/embedded_models/reward_model.py): its training
answers are labelled by the rule, and the shipped copy's recorded held-out accuracy is there and
better than chance. (That the shipped copy is current: test_recipe_digests.py.)"""

from __future__ import annotations

import json
import os

from examples.embedded_models.reward_model import NAME, candidates, written_flaws
from roll_ds.models.shipped import RECIPE_FILE, shipped_model

SHIPPED_DIR = shipped_model(NAME).path


def test_recorded_held_out_accuracy_beats_chance():
    with open(os.path.join(SHIPPED_DIR, RECIPE_FILE), encoding="utf-8") as f:
        held_out = json.load(f)["held_out"]
    for domain in ("overall", "math", "reverse"):
        assert held_out[domain]["pairwise_accuracy"] > 0.6
        assert held_out[domain]["policy_pairwise_accuracy"] > 0.6


def test_flaws_and_candidates_are_labelled_by_the_rule():
    assert set(written_flaws("math", "12", "9+3=")) >= {"-12", "13", "11", "22", "2", "1", ""}
    assert set(written_flaws("reverse", "cba", "reverse abc=")) >= {"cb", "ba", "abc", "bca"}
    row = {"prompt": "0-0=", "ground_truth": "0", "domain": "math"}
    out = candidates([row], [["0", "7", "0.0"]])
    labels = {c["response"]: c["label"] for c in out}
    assert labels["0"] == 1.0 and labels["0.0"] == 1.0 and labels["7"] == 0.0 and labels["1"] == 0.0
    assert len(out) == len(labels)  # deduplicated
    assert {c["response"] for c in out if c["sampled"]} == {"0", "7", "0.0"}
