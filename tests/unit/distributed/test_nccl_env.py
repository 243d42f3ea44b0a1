"""NCCL's dump-and-abort off in every device rank on GPUs (``Platform.process_env``), set
before the rank's first process group and never over a value the role's ``system_envs`` gave.

Why (roll_ds/platform.py, ``NCCL_PROCESS_ENV``): a timed-out weight-sync collective would
otherwise make the heartbeat monitor of the process's first NCCL group end a healthy trainer or
engine about 8 minutes later. What a GPU shows of it: scripts/gpu/check.py ``nccl``.
"""

from __future__ import annotations

import os

import pytest

from roll_ds.distributed.cluster import _rank_env, _with_rank_env
from roll_ds.distributed.placement import NodeInfo, RoleSpec
from roll_ds.distributed.resource_manager import ResourceManager
from roll_ds.platform import CPU, CUDA, NCCL_PROCESS_ENV

DUMP = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def test_the_platform_turns_the_dump_off_on_nccl_only():
    assert CUDA.process_env() == {DUMP: "0"} == NCCL_PROCESS_ENV
    assert CPU.process_env() == {}
    CUDA.process_env()[DUMP] = "1"  # a copy: the constant stays
    assert NCCL_PROCESS_ENV == {DUMP: "0"}


def _placements(device_resource: str):
    rm = ResourceManager(
        {"actor_train": RoleSpec((0, 1), 2), "rewards.math": RoleSpec((), 1)},
        num_gpus_per_node=2,
        device_resource=device_resource,
    )
    rm.nodes = {0: NodeInfo("n0", "10.0.0.1", {device_resource: 2, "CPU": 8})}
    rm.placement_groups = {0: object()}  # reserved (the strategy only holds it)
    return {role: [rm._placement(s) for s in slots] for role, slots in rm.plan.slots.items()}


def test_every_device_rank_gets_the_defaults_on_gpus_and_none_on_cpu():
    gpu = _placements("GPU")
    assert [p.env_defaults for p in gpu["actor_train"]] == [{DUMP: "0"}] * 2
    assert [p.env_defaults for p in gpu["rewards.math"]] == [{}]  # a CPU-only role: no NCCL
    assert DUMP not in _rank_env({}, gpu["actor_train"][0])  # a default, not a rank variable
    cpu = _placements("CPU")
    assert [p.env_defaults for p in cpu["actor_train"]] == [{}, {}]


class Seen:
    """Records the variables as its __init__ (Worker.__init__'s place) finds them."""

    def __init__(self) -> None:
        self.env = {k: os.environ.get(k) for k in (DUMP, "RANK")}


@pytest.mark.parametrize(("system_env", "expected"), [(None, "0"), ("1", "1")])
def test_the_default_is_set_before_the_worker_starts_and_system_envs_win(
    monkeypatch, system_env, expected
):
    """As in the actor: Ray's runtime_env (the role's system_envs) set the process's variables
    before it started; then the rank env, then the defaults where nothing is set."""
    monkeypatch.delenv(DUMP, raising=False)
    monkeypatch.setenv("RANK", "stale")
    if system_env is not None:
        monkeypatch.setenv(DUMP, system_env)
    actor = _with_rank_env(Seen)(_roll_ds_env={"RANK": "1"}, _roll_ds_env_defaults={DUMP: "0"})
    assert actor.env == {DUMP: expected, "RANK": "1"}  # the rank env is no default
    assert os.environ[DUMP] == expected  # what vLLM's worker processes inherit
