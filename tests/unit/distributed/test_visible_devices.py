"""An actor must see exactly the GPUs it reserved: checked at Worker start (pure function, fake
values; on CPU the check itself never runs)."""

from __future__ import annotations

from roll_ds.distributed.worker import Worker, visible_device_problem


def problem(reserved, visible, count):
    return visible_device_problem(
        role="actor_infer", rank=1, reserved=reserved, visible=visible, device_count=count
    )


def test_exactly_the_reserved_gpus_pass():
    assert problem(["3"], "3", 1) is None
    assert problem(["2"], "2,3", 2) is None  # a TP=2 worker: Ray names the first bundle's GPU


def test_an_unset_list_means_every_gpu_of_the_node():
    message = problem(["3"], None, 8)
    assert "actor_infer rank 1" in message and "all 8 GPUs" in message
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" in message


def test_a_list_without_the_reserved_gpu_is_named():
    message = problem(["3"], "0", 1)
    assert "does not list GPU 3" in message and "system_envs" in message


def test_cuda_initialised_before_the_rewrite_sees_too_few():
    """Cluster rewrites CUDA_VISIBLE_DEVICES to '2,3' for a TP=2 worker, but CUDA counted the
    single GPU Ray had exposed: vLLM's second TP worker would find no device of its own."""
    message = problem(["2"], "2,3", 1)
    assert "reserved 2 GPU(s)" in message and "CUDA sees 1" in message


def test_a_worker_outside_ray_starts_without_the_check():
    Worker()  # no Ray here: nothing to compare, nothing raised


def test_a_cpu_build_of_torch_checks_the_ids_only():
    """Ray's simulated cluster advertises GPUs a CPU build of torch can never see: the ids Ray
    set are still checked, the count is not (tests/integration/test_cluster_placement.py)."""
    assert problem(["0"], "0,1", None) is None
    assert "does not list GPU 3" in problem(["3"], "0", None)
    assert "every GPU of its node" in problem(["3"], None, None)
