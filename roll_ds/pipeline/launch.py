"""Start the pipeline a validated config describes."""

from __future__ import annotations

import sys

from roll_ds.config.schema import RLVRConfig


def run_pipeline(cfg: RLVRConfig) -> None:
    # The RLVR loop (rollout, reward, advantage, train, weight sync) lands with issue #6; until
    # then the entry point stops here, after the config has been composed and validated.
    print(
        f"roll_ds: config '{cfg.exp_name}' is valid (actor_train: "
        f"{cfg.actor_train.strategy_args.strategy_name}, ZeRO stage "
        f"{_stage(cfg)}). The RLVR pipeline is not implemented yet.",
        file=sys.stderr,
    )
    sys.exit(3)


def _stage(cfg: RLVRConfig) -> object:
    ds = cfg.actor_train.strategy_args.strategy_config
    return (ds or {}).get("zero_optimization", {}).get("stage", "-")
