"""ZeRO++ in a DeepSpeed config. Its keys (``zero_hpz_partition_size``,
``zero_quantized_weights``, ``zero_quantized_gradients``,
``zero_quantized_nontrainable_weights``) are ZeRO-3 keys for multi-node GPU runs:
``zeropp_problems`` refuses them below stage 3, ``zeropp_device_problems`` on CPU (their
quantizers are CUDA kernels), ``zeropp_topology_problems`` an hpZ that cannot pay off (one node)
or whose groups would span nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# ZeRO++'s switches (besides zero_hpz_partition_size): quantized all-gathers of the weights,
# quantized all-to-all reduction of the gradients, frozen weights stored quantized (MixZ++).
ZEROPP_FLAGS = (
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
)
HPZ_KEY = "zero_hpz_partition_size"


def zeropp_keys(ds_config: Mapping[str, Any]) -> list[str]:
    """The ZeRO++ keys ``ds_config`` switches on (``zero_optimization.<key>``)."""
    zero = ds_config.get("zero_optimization") or {}
    on = [key for key in ZEROPP_FLAGS if zero.get(key) is True]
    hpz = zero.get(HPZ_KEY, 1)
    if isinstance(hpz, int) and not isinstance(hpz, bool) and hpz > 1:
        on.insert(0, HPZ_KEY)
    return on


def zeropp_problems(ds_config: Mapping[str, Any], stage: int, where: str) -> list[str]:
    """ZeRO++ keys switched on outside ZeRO ``stage`` 3 (they partition ZeRO-3's parameters)."""
    keys = zeropp_keys(ds_config)
    if not keys or stage == 3:
        return []
    named = ", ".join(f"zero_optimization.{k}" for k in keys)
    return [
        f"{where}: {named} are ZeRO++ keys of ZeRO stage 3 (stage is {stage}); use "
        "${deepspeed_zero3} or remove them"
    ]


def zeropp_device_problems(ds_config: Mapping[str, Any], where: str, device: str) -> list[str]:
    """ZeRO++ keys on ``device`` "cpu": DeepSpeed's quantizers are CUDA kernels, and hpZ's
    intra-node copies save inter-node traffic only (the CPU accelerator could run an unquantized
    hpZ; it would only cost memory)."""
    keys = zeropp_keys(ds_config)
    if not keys or device != "cpu":
        return []
    named = ", ".join(f"zero_optimization.{k}" for k in keys)
    return [
        f"{where}: {named} (ZeRO++) need CUDA GPUs: the quantized all-gather and gradient "
        "reduction are CUDA kernels, and hierarchical partitioning only saves inter-node "
        "traffic; remove them (zero_hpz_partition_size: 1, the quantized flags false) or run "
        "with device: cuda"
    ]


def zeropp_topology_problems(
    ds_config: Mapping[str, Any], where: str, ranks_per_node: list[int]
) -> list[str]:
    """hpZ against the role's ranks on each node (``ranks_per_node``, the nodes it uses).
    DeepSpeed groups ranks ``[i*size, (i+1)*size)`` (consecutive: one node's ranks) and keeps a
    secondary copy of the parameters in each group, so that backward's all-gather never leaves
    the node: the size must divide every node's ranks, and on one node the copy saves nothing
    (ZeRO++ tutorial: set it to the GPUs per node of a multi-node run)."""
    zero = ds_config.get("zero_optimization") or {}
    hpz = zero.get(HPZ_KEY, 1)
    if HPZ_KEY not in zeropp_keys(ds_config) or not ranks_per_node:
        return []
    field = f"{where}.zero_optimization.{HPZ_KEY}"
    if len(ranks_per_node) == 1:
        return [
            f"{field}: {hpz} on a role whose {ranks_per_node[0]} ranks share one node: hpZ "
            "keeps a second, intra-node copy of the parameters to avoid inter-node all-gathers, "
            "so on one node it costs memory and saves nothing; set it to 1"
        ]
    uneven = sorted({n for n in ranks_per_node if n % hpz})
    if uneven:
        return [
            f"{field}: {hpz} does not divide the role's ranks per node "
            f"({', '.join(map(str, sorted(set(ranks_per_node))))}): a secondary partition group "
            "would span two nodes; set it to the ranks per node (or a divisor of it)"
        ]
    return []
