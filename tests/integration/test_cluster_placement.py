"""device_mapping -> placement on Ray's simulated multi-node cluster (2 raylets x 2 fake GPUs).

Everything is asserted from the actors' own view: the node id Ray's runtime context reports and
the GPU ids Ray assigned them (``get_accelerator_ids``, mirrored in CUDA_VISIBLE_DEVICES).
One cluster for the module: each Ray start costs several seconds on a 2-core box.

The simulated GPUs do not exist: the first test checks that the driver, whose own torch has no
CUDA, still plans for the GPUs the cluster advertises (placement only; nothing touches CUDA).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster as RayTestCluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from roll_ds.config import load_config  # noqa: E402
from roll_ds.distributed.batch import Batch  # noqa: E402
from roll_ds.distributed.cluster import Cluster  # noqa: E402
from roll_ds.distributed.dispatch import Dispatch, register  # noqa: E402
from roll_ds.distributed.errors import PlacementError  # noqa: E402
from roll_ds.distributed.placement import RoleSpec  # noqa: E402
from roll_ds.distributed.ray_init import connect  # noqa: E402
from roll_ds.distributed.resource_manager import ResourceManager  # noqa: E402
from roll_ds.distributed.worker import Worker  # noqa: E402
from roll_ds.platform import current_platform, use_platform  # noqa: E402
from roll_ds.threads import role_threads  # noqa: E402

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors need not import this file


class Probe(Worker):
    def env(self) -> dict[str, str | None]:
        keys = (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "ROLL_DS_NODE",
            "ROLL_DS_NODE_LOCAL_RANK",
            "OMP_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES",
            "ROLE_FLAG",
            "ROLL_DS_DEVICE",
        )
        return {k: os.environ.get(k) for k in keys}

    @register(Dispatch.DP)
    def tag(self, batch: Batch) -> Batch:
        return batch.union(Batch({"rank_B": torch.full((len(batch),), self.rank)}))

    @register(Dispatch.RANK0)
    def whoami(self) -> int:
        return self.rank


class GpuProbe(Worker):
    def gpu(self) -> dict:
        return {
            "count": torch.cuda.device_count(),
            "uuid": str(torch.cuda.get_device_properties(0).uuid),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }


@pytest.mark.gpu
def test_real_gpus_each_actor_sees_exactly_its_own():
    """On a GPU machine (runs before the simulated cluster starts): one GPU per actor, colocated
    roles on the same physical GPU."""
    n = torch.cuda.device_count()
    conn = connect(num_cpus=2 * n + 2, log_to_driver=False)
    assert conn.resources.get("GPU") == n
    rm = ResourceManager(
        {"actor_train": RoleSpec(tuple(range(n)), n), "actor_infer": RoleSpec(tuple(range(n)), n)},
        num_gpus_per_node=n,
        device_resource="GPU",
    )
    try:
        train = Cluster("actor_train", GpuProbe, rm)
        infer = Cluster("actor_infer", GpuProbe, rm)
        seen_train, seen_infer = train.gpu(), infer.gpu()
        assert [s["count"] for s in seen_train + seen_infer] == [1] * (2 * n)
        assert len({s["uuid"] for s in seen_train}) == n
        assert [s["uuid"] for s in seen_train] == [s["uuid"] for s in seen_infer]
        train.shutdown()
        infer.shutdown()
    finally:
        rm.release()
        ray.shutdown()


@pytest.fixture(scope="module")
def two_nodes():
    cluster = RayTestCluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=4, num_gpus=2)
    conn = connect(cluster.address, log_to_driver=False)  # the join-a-cluster path
    assert not conn.started_local and conn.address == cluster.address
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def placed(two_nodes):
    """actor_train on list(range(0,4)) and actor_infer (2 devices a worker) on the same devices."""
    rm = ResourceManager(
        {
            "actor_train": RoleSpec(tuple(range(4)), 4, 1),
            "actor_infer": RoleSpec(tuple(range(4)), 2, 2),
        },
        num_gpus_per_node=2,
        num_nodes=2,
        device_resource="GPU",
        cpus_per_device=0.5,
        ready_timeout_s=30,
    ).reserve()
    train = Cluster("actor_train", Probe, rm, env={"ROLE_FLAG": "train"}, start_timeout_s=120)
    infer = Cluster("actor_infer", Probe, rm, start_timeout_s=120)
    yield rm, train, infer
    train.shutdown()
    infer.shutdown()
    rm.release()


def test_driver_without_cuda_plans_for_the_clusters_gpus(two_nodes):
    """A CPU-only driver (a KubeRay head, ``ray job submit``) on a cluster with GPUs: the plan is
    GPU, its bundles ask for GPUs and get created, the ranks are told they run on CUDA, and the
    driver's own transport choice reads CUDA. (Runs before ``placed`` holds the GPUs.)"""
    assert not torch.cuda.is_available()
    cfg = load_config(
        "rlvr_lora_zero3",
        [
            "num_gpus_per_node=2",
            "num_nodes=2",
            "actor_train.device_mapping=[0,1,2,3]",
            "actor_train.training_args.per_device_train_batch_size=8",
            "actor_infer.device_mapping=[2,3]",
            "actor_infer.num_gpus_per_worker=2",
        ],
        check_files=False,
    )
    assert cfg.device == "auto"
    previous = use_platform(None)
    try:
        rm = ResourceManager.from_config(cfg, ready_timeout_s=30).reserve()
        try:
            assert current_platform().is_cuda and current_platform().dist_backend == "nccl"
            assert rm.plan.device_resource == "GPU"
            # each simulated node: 4 CPUs, 2 GPUs -> (4 - 1) // 2 = 1 CPU per GPU bundle
            assert rm.plan.bundle_resources() == {"GPU": 1.0, "CPU": 1.0}
            for node, pg in rm.placement_groups.items():
                table = placement_group_table(pg)
                assert table["state"] == "CREATED", (node, table)
                assert list(table["bundles"].values()) == [{"GPU": 1.0, "CPU": 1.0}] * 2
            train = rm.placements("actor_train")
            assert [p.options["num_gpus"] for p in train] == [1.0, 1.0, 0.5, 0.5]  # 2, 3 shared
            assert {p.env["ROLL_DS_DEVICE"] for p in train} == {"cuda"}
            assert role_threads(cfg, on_cuda=True, plan=rm.plan)["actor_train"] == 1
            # the decision reaches the rank: a 2-GPU rollout worker on node 1
            infer = Cluster("actor_infer", Probe, rm, start_timeout_s=120)
            try:
                (env,) = infer.env()
                assert env["ROLL_DS_DEVICE"] == "cuda"
                assert sorted(env["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]
                assert infer.infos[0]["node_id"] == head_and_other(two_nodes)[1]
            finally:
                infer.shutdown()
        finally:
            rm.release()
    finally:
        use_platform(previous)
    # Placement groups are removed asynchronously: the tests below need every GPU back.
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)


def head_and_other(two_nodes) -> tuple[str, str]:
    head = two_nodes.head_node.node_id
    other = next(n.node_id for n in two_nodes.list_all_nodes() if n.node_id != head)
    return head, other


def test_ranks_0_1_on_node_a_and_2_3_on_node_b(two_nodes, placed):
    rm, train, _ = placed
    node_a, node_b = head_and_other(two_nodes)
    nodes = [info["node_id"] for info in train.infos]
    assert nodes == [node_a, node_a, node_b, node_b]
    gpus = [info["accelerator_ids"]["GPU"] for info in train.infos]
    assert sorted(gpus[:2]) == [["0"], ["1"]] and sorted(gpus[2:]) == [["0"], ["1"]]
    # each actor sees exactly the GPU Ray assigned it
    assert [info["visible_devices"] for info in train.infos] == [g[0] for g in gpus]
    # the placement groups themselves sit on the nodes their device ids name
    assert set(rm.bundle_node_ids(0).values()) == {node_a}
    assert set(rm.bundle_node_ids(1).values()) == {node_b}


def test_rank_env(placed):
    _, train, _ = placed
    envs = train.env()
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["LOCAL_RANK"] for e in envs} == {"0"}  # each actor's own GPU is its device 0
    assert [e["ROLL_DS_NODE"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["ROLL_DS_NODE_LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["MASTER_ADDR"] for e in envs} == {train.infos[0]["node_ip"]}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert {e["ROLE_FLAG"] for e in envs} == {"train"}  # system_envs
    assert train.whoami() == 0


def test_colocated_roles_share_bundles(placed):
    rm, train, infer = placed
    # infer rank r holds devices (2r, 2r+1): the same node and GPUs as train ranks 2r and 2r+1
    for r, info in enumerate(infer.infos):
        mates = train.infos[2 * r : 2 * r + 2]
        assert info["node_id"] == mates[0]["node_id"] == mates[1]["node_id"]
        expected = ",".join(m["accelerator_ids"]["GPU"][0] for m in mates)
        assert info["visible_devices"] == expected
        assert info["accelerator_ids"]["GPU"] == mates[0]["accelerator_ids"]["GPU"]
    # two roles on each device: half a GPU each, and only the planned bundles exist
    assert {p.options["num_gpus"] for p in rm.placements("actor_train")} == {0.5}
    assert len(rm.placement_groups) == 2


def test_dp_round_trip_across_two_ranks(placed):
    _, _, infer = placed
    batch = Batch({"x_B": torch.arange(5)}, {"id": list("abcde")}, {"step": 3})
    out = infer.tag(batch)
    assert out["x_B"].tolist() == [0, 1, 2, 3, 4]
    assert out["id"].tolist() == list("abcde")
    assert out["rank_B"].tolist() == [0, 0, 0, 1, 1]  # uneven: rank 0 takes the extra row
    assert out.meta == {"step": 3}


def test_oversize_mapping_fails_fast_with_numbers(placed):
    rm = ResourceManager(
        {"actor_train": RoleSpec(tuple(range(6)), 6)},
        num_gpus_per_node=2,
        device_resource="GPU",
        ready_timeout_s=30,
    )
    start = time.perf_counter()
    with pytest.raises(PlacementError) as info:
        rm.reserve()
    assert time.perf_counter() - start < 5
    msg = str(info.value)
    assert "device_mapping needs 3 node(s) with >= 2 GPU each" in msg
    assert "(device ids 0-5 with num_gpus_per_node 2 -> nodes 0-2)" in msg
    assert "the Ray cluster has 2 such node(s)" in msg
    assert not rm.placement_groups


def _all_reduce_rank(worker: Worker) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(worker.rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_process_group_over_master_addr_and_port(placed):
    _, _, infer = placed
    infer.init_process_group(backend="gloo", timeout_s=60)
    assert infer.execute(_all_reduce_rank) == [3.0, 3.0]
