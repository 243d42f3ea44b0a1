"""A local Ray with the roles' placement reserved, for the tests that start real clusters.

    @pytest.fixture(scope="module")
    def rm():
        with reserved({"actor_infer": RoleSpec((0, 1), 2)}, num_gpus_per_node=2) as manager:
            yield manager

Connects its own Ray (an inherited ``RAY_ADDRESS`` is set aside and put back), reserves the
bundles on CPU, and releases and shuts down afterwards.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import ray

from roll_ds.distributed.placement import RoleSpec
from roll_ds.distributed.ray_init import connect
from roll_ds.distributed.resource_manager import ResourceManager


@contextlib.contextmanager
def reserved(
    roles: Mapping[str, RoleSpec],
    *,
    num_gpus_per_node: int,
    num_cpus: int = 4,
    ready_timeout_s: float = 60,
) -> Iterator[ResourceManager]:
    saved = os.environ.pop("RAY_ADDRESS", None)
    connect(num_cpus=num_cpus, log_to_driver=False)
    manager = ResourceManager(
        dict(roles),
        num_gpus_per_node=num_gpus_per_node,
        device_resource="CPU",
        ready_timeout_s=ready_timeout_s,
    ).reserve()
    try:
        yield manager
    finally:
        manager.release()
        ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
