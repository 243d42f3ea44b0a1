"""Placement planning (pure): device ids -> nodes and bundles, colocation shares, clear refusals."""

import os

import pytest

from roll_ds.config import load_config
from roll_ds.distributed.errors import PlacementError
from roll_ds.distributed.placement import (
    NodeInfo,
    RoleSpec,
    cpus_per_gpu,
    match_nodes,
    plan_placement,
)
from roll_ds.distributed.resource_manager import role_specs_from_config


def plan(roles, **kw):
    kw.setdefault("num_gpus_per_node", 2)
    return plan_placement(roles, **kw)


def node(node_id, ip="10.0.0.1", gpus=2, cpus=8, head=False, alive=True):
    resources = {"GPU": gpus, "CPU": cpus}
    if head:
        resources["node:__internal_head__"] = 1
    return NodeInfo(node_id, ip, resources, is_head=head, alive=alive)


def test_16_gpus_on_2_nodes_like_the_example():
    p = plan({"actor_train": RoleSpec(tuple(range(16)), 16)}, num_gpus_per_node=8, num_nodes=2)
    slots = p.slots["actor_train"]
    assert [s.node for s in slots] == [0] * 8 + [1] * 8
    assert [s.local_devices for s in slots] == [(i % 8,) for i in range(16)]
    assert [s.bundle for s in slots] == [i % 8 for i in range(16)]
    assert [s.node_local_rank for s in slots] == [i % 8 for i in range(16)]
    assert p.node_devices == {0: tuple(range(8)), 1: tuple(range(8))}
    assert all(s.device_share == 1.0 and s.cpu_share == 1.0 for s in slots)
    assert p.bundles(0) == [{"GPU": 1.0, "CPU": 1.0}] * 8


def test_the_shipped_16_gpu_config():
    cfg = load_config("rlvr_qwen2.5_7b_lora_zero3_16gpu", check_files=False)
    specs = role_specs_from_config(cfg)
    assert specs["actor_train"] == RoleSpec(tuple(range(16)), 16, 1)
    assert specs["actor_infer"] == RoleSpec(tuple(range(16)), 8, 2)
    assert specs["rewards.math"] == RoleSpec((), 8, 0)
    p = plan_placement(specs, num_gpus_per_node=cfg.num_gpus_per_node, num_nodes=cfg.num_nodes)
    infer = p.slots["actor_infer"]
    assert [s.devices for s in infer] == [(2 * i, 2 * i + 1) for i in range(8)]
    assert [s.node for s in infer] == [0] * 4 + [1] * 4
    assert [s.bundles for s in infer][4] == (0, 1)  # devices 8, 9 = node 1, local 0 and 1
    # actor_train and actor_infer share every device: half of each bundle each
    assert {s.device_share for s in p.slots["actor_train"]} == {0.5}
    assert {s.device_share for s in infer} == {0.5}
    assert [s.node for s in p.slots["rewards.math"]] == [None] * 8


def test_local_ray_declares_enough_cpus_for_the_embedded_default():
    from roll_ds.distributed.ray_init import local_num_cpus

    cfg = load_config("rlvr_lora_zero3", check_files=False)
    # 2 device slots (1 CPU each) + 2 reward actors x 0.1 CPU = 2.2 -> 3, + 1 for probes
    assert local_num_cpus(cfg) == max(os.cpu_count() or 1, 4)


def test_colocated_roles_share_bundles_with_fractions_that_fit():
    p = plan(
        {
            "train": RoleSpec((0, 1), 2),
            "infer": RoleSpec((0,), 1),
            "ref": RoleSpec((0, 1), 2),
        }
    )
    assert p.sharing == {0: ("train", "infer", "ref"), 1: ("train", "ref")}
    train, infer, ref = p.slots["train"], p.slots["infer"], p.slots["ref"]
    assert train[0].bundle == infer[0].bundle == ref[0].bundle == 0
    assert train[0].device_share == pytest.approx(0.3333)
    assert 3 * train[0].device_share <= 1.0  # rounded down to Ray's grain
    assert train[1].device_share == 0.5
    assert p.num_devices == 2


def test_cpu_only_roles_and_cpu_slots():
    p = plan(
        {"train": RoleSpec((0, 1), 2), "reward": RoleSpec((), 3)},
        device_resource="CPU",
        cpus_per_cpu_worker=0.25,
    )
    assert p.bundle_resources() == {"CPU": 1.0}
    assert [s.cpu_share for s in p.slots["train"]] == [1.0, 1.0]
    reward = p.slots["reward"]
    assert [(s.node, s.bundle, s.cpu_share) for s in reward] == [(None, None, 0.25)] * 3
    assert p.total_cpus() == pytest.approx(2.75)


def test_only_used_devices_get_bundles():
    p = plan({"infer": RoleSpec((2, 3), 2)})
    assert p.node_devices == {1: (0, 1)}
    assert [s.bundle for s in p.slots["infer"]] == [0, 1]


@pytest.mark.parametrize(
    ("spec", "kw", "message"),
    [
        (RoleSpec((1, 2), 1, 2), {}, r"worker devices \[1, 2\] span nodes \[0, 1\]"),
        (
            RoleSpec((0, 1, 2, 3), 4),
            {"num_nodes": 1},
            r"device ids \[2, 3\] are beyond num_nodes 1",
        ),
        (RoleSpec((0, 1), 3), {}, r"2 devices != world_size 3 x devices_per_worker 1"),
        (RoleSpec((0, 0), 2), {}, "repeat"),
        (RoleSpec((), 0), {}, "world_size >= 1"),
    ],
)
def test_bad_roles_are_refused_with_the_numbers(spec, kw, message):
    with pytest.raises(PlacementError, match=message):
        plan({"r": spec}, **kw)


def test_nodes_are_ordered_head_first_then_by_ip():
    p = plan({"train": RoleSpec((0, 1, 2, 3, 4, 5), 6)})
    nodes = [node("c", "10.0.0.10"), node("b", "10.0.0.9"), node("a", "10.0.0.20", head=True)]
    matched = match_nodes(p, nodes)
    assert {i: n.node_id for i, n in matched.items()} == {0: "a", 1: "b", 2: "c"}


def test_nodes_without_enough_devices_or_dead_are_skipped():
    p = plan({"train": RoleSpec((0, 1, 2, 3), 4)})
    nodes = [
        node("head", gpus=0, head=True),
        node("x", "10.0.0.2"),
        node("y", "10.0.0.3", gpus=1),
        node("z", "10.0.0.4", alive=False),
        node("w", "10.0.0.5"),
    ]
    assert [n.node_id for n in match_nodes(p, nodes).values()] == ["x", "w"]


def test_oversize_mapping_names_the_numbers():
    p = plan({"train": RoleSpec(tuple(range(6)), 6)})
    with pytest.raises(PlacementError) as info:
        match_nodes(p, [node("aaaaaaaaaa", head=True), node("bbbbbbbbbb", "10.0.0.2")])
    msg = str(info.value)
    assert "needs 3 node(s) with >= 2 GPU each" in msg
    assert "device ids 0-5 with num_gpus_per_node 2 -> nodes 0-2" in msg
    assert "the Ray cluster has 2 such node(s): node aaaaaaaa (10.0.0.1) GPU=2" in msg


def test_too_few_cpus_is_refused_before_reserving():
    p = plan({"train": RoleSpec((0, 1), 2), "reward": RoleSpec((), 4)}, cpus_per_cpu_worker=0.5)
    with pytest.raises(
        PlacementError, match=r"needs 4 CPUs \(2 device bundles x 1 \+ 2 for CPU-only"
    ):
        match_nodes(p, [node("a", cpus=3)])


@pytest.mark.parametrize(
    ("cpus", "gpus", "expected"),
    [
        (64, 8, 7.0),  # one CPU per node left for reward actors, probes and Ray
        (96, 8, 11.0),
        (16, 8, 1.0),
        (4, 2, 1.0),
        (8, 8, 1.0),  # 8 CPUs: 7/8 < 1 after headroom -> the exact share, no headroom
        (6, 8, 0.75),
    ],
)
def test_cpus_per_gpu_from_the_gpu_nodes(cpus, gpus, expected):
    nodes = [node(n, f"10.0.0.{i}", gpus=gpus, cpus=cpus) for i, n in enumerate("ab", 2)]
    assert cpus_per_gpu(nodes, gpus, num_nodes=2) == expected


def test_cpus_per_gpu_ignores_the_cpu_head_and_unused_nodes():
    nodes = [
        node("head", "10.0.0.1", gpus=0, cpus=8, head=True),  # KubeRay's CPU-only head
        node("a", "10.0.0.2", gpus=8, cpus=64),
        node("b", "10.0.0.3", gpus=8, cpus=96),
        node("c", "10.0.0.4", gpus=8, cpus=16),  # not among the 2 nodes placement uses
    ]
    assert cpus_per_gpu(nodes, 8, num_nodes=2) == 7.0
    assert cpus_per_gpu(nodes, 8, num_nodes=3) == 1.0
    assert cpus_per_gpu([nodes[0]], 8, num_nodes=1) == 1.0  # no GPU node: match_nodes reports it


def test_plan_cli_prints_the_16_gpu_plan(capsys):
    from roll_ds.distributed.plan_cli import main

    main(["rlvr_qwen2.5_7b_lora_zero3_16gpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "num_gpus_per_node 8, num_nodes 2 (GPU view)"
    assert "node 1: devices 8-15 = local 0-7, bundles of {'GPU': 1.0, 'CPU': 1.0}" in lines
    assert lines[-2] == "rewards.math: 8 CPU actor(s) x 0.1 CPU"
    assert any(line.startswith("actor_infer: r0@n0:0-1 r1@n0:2-3") for line in lines)


def test_plan_cli_on_cpu_and_without_a_config(capsys):
    from roll_ds.distributed.plan_cli import main

    main(["rlvr_lora_zero3", "device=cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "num_gpus_per_node 2, num_nodes 1 (CPU slots)",
        "node 0: devices 0-1 = local 0-1, bundles of {'CPU': 1.0}",
    ]
    with pytest.raises(SystemExit, match=r"usage: python -m roll_ds\.distributed\.plan_cli"):
        main([])


# --- device: auto resolved to CUDA: the weight-sync layout is checked before actors start -----


def _auto_cfg(*overrides: str):
    """A ``device: auto`` config validated as for a joined cluster (its GPUs unknown until
    it is connected): the device checks run at ``decide_run_platform``."""
    from roll_ds.config import load_config

    overrides = ["num_gpus_per_node=4", "ray.address=ray://head:10001", *overrides]
    return load_config("rlvr_lora_zero3", overrides, check_files=False)


def test_auto_on_gpus_refuses_a_partly_colocated_layout_before_any_actor():
    from roll_ds.config.validate import ConfigError
    from roll_ds.distributed.resource_manager import check_resolved_device

    cfg = _auto_cfg("actor_train.device_mapping=[0,1]", "actor_infer.device_mapping=[1,2]")
    assert cfg.device == "auto"  # validation could not know the cluster's ids are GPUs
    with pytest.raises(ConfigError, match=r"weight_sync\.transport"):
        check_resolved_device(cfg, "cuda")


def test_auto_on_gpus_accepts_colocated_and_separate_layouts():
    from roll_ds.distributed.resource_manager import check_resolved_device

    for infer in ("[0,1]", "[2,3]"):
        cfg = _auto_cfg("actor_train.device_mapping=[0,1]", f"actor_infer.device_mapping={infer}")
        check_resolved_device(cfg, "cuda")
