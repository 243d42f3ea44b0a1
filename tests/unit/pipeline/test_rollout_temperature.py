"""The one temperature every trainer-side log-prob uses: the rollouts' sampling temperature."""

from __future__ import annotations

import pytest

from roll_ds.config.compose import load_config
from roll_ds.pipeline.startup import rollout_temperature


@pytest.mark.parametrize(("sampled", "scored"), [(1.0, 1.0), (0.7, 0.7), (1.3, 1.3), (0.0, 1.0)])
def test_trainer_scores_at_the_rollout_temperature(sampled, scored):
    cfg = load_config("rlvr_lora_zero3", [f"actor_infer.generating_args.temperature={sampled}"])
    # Greedy rollouts (0) are scored by the untempered model.
    assert rollout_temperature(cfg) == scored
