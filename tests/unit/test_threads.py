"""The thread plan: what each role's actors compute with (roll_ds/threads.py)."""

from roll_ds.config import load_config
from roll_ds.threads import role_threads


def _plan(*overrides: str, on_cuda: bool = False) -> dict:
    cfg = load_config("rlvr_lora_zero3", list(overrides), check_files=False)
    return role_threads(cfg, on_cuda=on_cuda)


def test_synchronous_loop_gives_the_rollout_engine_the_whole_node():
    # Generation runs alone: vLLM takes both CPU slots the roles use; the trainer's two ranks
    # run side by side on one slot each.
    assert _plan() == {
        "actor_train": 1,
        "actor_infer": 2,
        "rewards.math": 1,
        "rewards.reverse": 1,
    }


def test_asynchronous_loop_splits_the_node():
    plan = _plan("async_generation.max_staleness=1")
    assert plan["actor_infer"] == 1 and plan["actor_train"] == 1


def test_a_role_setting_wins_and_gpus_keep_their_reserved_cpus():
    assert _plan("actor_infer.num_threads=3")["actor_infer"] == 3
    assert _plan("actor_train.num_threads=2", on_cuda=True) == {
        "actor_train": 2,
        "actor_infer": None,
        "rewards.math": None,
        "rewards.reverse": None,
    }


def test_only_the_engines_node_counts():
    plan = _plan(
        "num_gpus_per_node=2",
        "num_nodes=2",
        "actor_train.device_mapping=[0,1,2,3]",
        "actor_infer.device_mapping=[2]",
        "actor_train.training_args.per_device_train_batch_size=8",
    )
    assert plan["actor_infer"] == 2  # node 1 holds slots 2 and 3
