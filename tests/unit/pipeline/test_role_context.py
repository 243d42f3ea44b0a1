"""What each role's strategy is built with besides its config (``startup.role_context``)."""

from __future__ import annotations

from roll_ds.config.compose import load_config
from roll_ds.pipeline.startup import role_context
from roll_ds.strategy import StrategyContext


def test_the_rollout_engine_holds_the_longest_sequence_and_no_other_role_is_told():
    cfg = load_config(
        "rlvr_full_zero3",
        ["prompt_length=100", "validation.generating_args.max_new_tokens=24"],
        check_files=False,
    )
    ctx = StrategyContext(pretrain="/m", seed=0, max_steps=10, response_length=8)
    # the evaluation's 24 new tokens are the longest generation (eval_steps > 0)
    assert role_context(cfg, ctx, "actor_infer", ["actor_train"]).max_sequence_length == 124
    for role in ("actor_train", "reference"):
        assert role_context(cfg, ctx, role, ["actor_train"]).max_sequence_length is None


def test_every_role_gets_its_own_nvme_directory_under_the_run(tmp_path):
    """``nvme_path: auto`` (ZeRO-Infinity): one directory per role, DeepSpeed's swap files being
    named by rank and parameter only."""
    cfg = load_config("rlvr_full_zero3", [f"output_dir={tmp_path}"], check_files=False)
    ctx = StrategyContext(pretrain="/m", seed=0, max_steps=10, response_length=8)
    dirs = {
        role: role_context(cfg, ctx, role, ["actor_train"]).nvme_dir
        for role in ("actor_train", "reference", "actor_infer")
    }
    for role, path in dirs.items():
        assert path == str(tmp_path / cfg.exp_name / "nvme" / role)
