"""roll_ds.host: the host record printed by scripts/test.sh and kept with every benchmark JSON."""

from __future__ import annotations

import re
from pathlib import Path

from roll_ds import host

ROOT = Path(__file__).resolve().parents[2]

# two processors of each host kind the project has run on (flags cut to what matters here)
INTEL = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
AMD = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 avx512f avx512_bf16
"""


def test_cpu_info_reads_the_model_and_the_features_that_change_what_runs():
    intel = host.cpu_info(INTEL)
    assert intel["cpu_model"].startswith("Intel(R) Xeon(R) Platinum 8481C")
    assert intel["cpu_flags"] == [
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_fp16",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    ]
    amd = host.cpu_info(AMD)
    assert amd == {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]}
    assert host.cpu_info("")["cpu_flags"] == []  # no /proc/cpuinfo: nothing claimed


def test_host_record_of_this_machine_and_its_line():
    record = host.host_record(onednn=True)
    assert record["cpus"] >= 1 and 1 <= record["cpus_usable"] <= record["cpus"]
    assert isinstance(record["onednn"]["fp16"], bool)
    # oneDNN's fp16 verdict is the one DeepSpeed's CPU accelerator gives
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        assert record["onednn"]["fp16"] == bool(get_accelerator().is_fp16_supported())
    line = host.describe(record)
    assert line.startswith(f"host: {record['cpu_model']}; features: ")
    assert "oneDNN fp16 " in line and f"{record['cpus_usable']} cpus usable" in line


def test_with_host_keeps_readers_working():
    rec = {"cpu_model": "X"}
    assert host.with_host({"a": 1}, rec) == {"a": 1, "host": rec}
    assert host.with_host([{"r": 1}, {"r": 2}], rec) == [
        {"r": 1, "host": rec},
        {"r": 2, "host": rec},
    ]
    assert host.with_host(3, rec) == 3


def test_every_benchmark_that_writes_a_result_records_its_host():
    """A benchmark whose JSON lacks the host cannot say which CPU its figure came from."""
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        writes = re.search(r"write_results\(|json\.dumps?\(", text)
        if not writes or path.name == "trl_grpo_step.py":  # writes through rlvr_step's writer
            continue
        assert "roll_ds.host import" in text, f"{path.name} writes JSON without its host"
