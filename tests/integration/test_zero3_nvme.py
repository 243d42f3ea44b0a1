"""ZeRO-3 with parameters and optimizer states on NVMe (ZeRO-Infinity, ${deepspeed_zero3_nvme})
trains like ZeRO-3 without offload: 2 optimizer steps of full fine-tuning of the embedded model on
2 CPU ranks, every metric equal within fp32 tolerance, the states really on disk.

Needs libaio (scripts/setup.sh installs libaio-dev as root); DeepSpeed builds its async I/O op on
first use (cached under TORCH_EXTENSIONS_DIR, docs/zero.md says how long it took here)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from _dist import run_distributed
from _pipeline_run import is_volatile
from _train_helpers import make_strategy, nll_loss, rank_batch

from roll_ds.config.deepspeed import nvme_paths
from strategies.deepspeed.nvme import libaio_available, model_size

pytestmark = [
    pytest.mark.integration,
    # Slow, not in CI: on a fresh machine DeepSpeed first compiles its async_io op, 11.5 CPU
    # minutes measured here (the run itself takes under a minute once the op is cached).
    pytest.mark.slow,
    pytest.mark.skipif(not libaio_available(), reason="libaio-dev missing (scripts/setup.sh)"),
]

STEPS = 2
# As test_zero_parity.py: fp32; NVMe runs the optimizer step in DeepSpeedCPUAdam (ZeRO-3 alone in
# torch's AdamW) and reduces in another order. Measured here: equal to 1e-7 relative.
RTOL, ATOL = 5e-6, 1e-6
# Every parameter on NVMe (max_in_cpu 0: no host-memory copy), none persisted on every rank.
# DeepSpeed keeps tensors under max(1 MiB, aio.block_size) in memory (swap_tensor/utils.py
# MIN_AIO_BYTES): every tensor of the embedded model (312k parameters, 625 KB of fp32 per rank)
# would stay there, and the disk path go untested. The ranks lower the floor to 4 KiB and the
# requests to 4 KiB blocks: every weight matrix and the optimizer's sub-group then go to disk.
SMALL_IO = 4096
AIO = {"aio": {"block_size": SMALL_IO, "queue_depth": 8, "intra_op_parallelism": 1}}
ZERO = {"stage3_param_persistence_threshold": 0}
PARAM = {"device": "nvme", "nvme_path": "auto", "buffer_count": 5, "buffer_size": "auto"}
NVME = {**ZERO, "offload_param": {**PARAM, "max_in_cpu": 0}}


def _io_written() -> int:
    """Bytes this process has caused to be written to storage (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def _swap_small_tensors() -> None:
    from deepspeed.runtime.swap_tensor import optimizer_utils, partitioned_param_swapper

    optimizer_utils.MIN_AIO_BYTES = partitioned_param_swapper.MIN_AIO_BYTES = SMALL_IO


def _train(model_path: str, nvme_dir: str) -> dict:
    _swap_small_tensors()
    out: dict = {}
    for key in (3, "3_nvme"):
        zero = NVME if key == "3_nvme" else ZERO
        start, written = time.perf_counter(), _io_written()
        s = make_strategy(
            model_path,
            key,
            zero=zero,
            ds_extra=AIO if key == "3_nvme" else None,
            seed=0,
            max_steps=STEPS,
            nvme_dir=nvme_dir,
            warmup_steps=1,
        )
        batch = rank_batch(s.rank)
        out[f"{key}_init_s"], start = time.perf_counter() - start, time.perf_counter()
        out[str(key)] = [s.train_step(batch, nll_loss) for _ in range(STEPS)]
        out[f"{key}_s"] = time.perf_counter() - start
        out[f"{key}_written"] = _io_written() - written
        if key == "3_nvme":
            out["paths"] = nvme_paths(s.ds_config)
            out["on_disk"] = sum(p.stat().st_size for p in Path(nvme_dir).rglob("*.swp"))
        s.close()
    return out


def test_zero3_nvme_equals_zero3(tiny_qwen2_dir, tmp_path):
    nvme_dir = str(tmp_path / "nvme" / "actor_train")
    results = run_distributed(_train, world_size=2, args=(tiny_qwen2_dir, nvme_dir), timeout_s=400)
    for rank, res in enumerate(results):
        ref, got = res["3"], res["3_nvme"]
        assert ref[1]["loss"] < ref[0]["loss"], f"rank {rank}: {ref}"
        for step, (a, b) in enumerate(zip(ref, got, strict=True)):
            assert b.keys() == a.keys()
            for name, value in a.items():
                if is_volatile(name):  # perf/*: FLOPs over wall-clock seconds
                    continue
                assert b[name] == pytest.approx(value, rel=RTOL, abs=ATOL), (
                    f"rank {rank} step {step} {name}: NVMe {b[name]} vs ZeRO-3 {value}"
                )
        assert res["paths"] == {"offload_param": nvme_dir, "offload_optimizer": nvme_dir}
    # both ranks' swap files: the fp32 parameters (4 bytes) and the optimizer's fp32 master
    # weights, moments and gradients (16 bytes), plus DeepSpeed's alignment padding (each file a
    # multiple of 4 KiB here; the norms' small tensors stay in memory)
    numel = model_size(tiny_qwen2_dir).numel
    on_disk = results[0]["on_disk"]
    assert os.path.isdir(os.path.join(nvme_dir, "zero_stage_3", "float32params", "rank0"))
    assert os.path.isdir(os.path.join(nvme_dir, "zero_stage_3", "optimizer", "rank1"))
    assert numel * (4 + 16) <= on_disk <= 2 * numel * (4 + 16), (on_disk, numel)
    r0 = results[0]
    print(
        f"\nrank 0: zero3 init {r0['3_init_s']:.1f} s + {STEPS} steps {r0['3_s']:.2f} s; "
        f"zero3_nvme init {r0['3_nvme_init_s']:.1f} s + {STEPS} steps {r0['3_nvme_s']:.2f} s; "
        f"swap files {on_disk} bytes; written per rank "
        f"{[r['3_nvme_written'] for r in results]} (ZeRO-3 alone: "
        f"{[r['3_written'] for r in results]})"
    )
