"""``device: auto`` is resolved before any actor starts (``roll_ds.platform.planned_device``:
a local Ray is this machine), and the checks that depend on the device run in validation with
it: ZeRO++ and ``cuda_ipc`` on a machine without CUDA are config errors, not tracebacks after
the roles started. Whether this machine has a GPU is the boundary faked (``planned_device``'s
answer); the checks themselves run for real."""

from __future__ import annotations

import sys

import pytest
from _config_problems import problems

from roll_ds import platform
from roll_ds.config import load_config
from roll_ds.config.checks import device as device_checks
from roll_ds.platform import GPU_DRIVER_FILES, planned_device

QUANTIZED = "deepspeed_zero3.zero_optimization.zero_quantized_weights=true"
FULL = "actor_train.model_args.lora_rank=null"


@pytest.fixture
def machine(monkeypatch):
    """Make this machine one with (``"cuda"``) or without (``"cpu"``) CUDA GPUs."""

    def as_(device: str) -> None:
        monkeypatch.setattr(
            device_checks,
            "planned_device",
            lambda named, address: planned_device(named, address) if address else device,
        )

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return as_


def test_zeropp_under_auto_on_a_machine_without_cuda(machine):
    machine("cpu")
    (line,) = problems(FULL, QUANTIZED)
    assert line.startswith(
        "actor_train.strategy_args.strategy_config: zero_optimization.zero_quantized_weights "
        "(ZeRO++) need CUDA GPUs"
    )
    assert line.endswith(
        "[device: auto is cpu here: this machine has no CUDA GPU, and a local Ray runs on it]"
    )


def test_zeropp_under_auto_on_a_gpu_machine_validates(machine):
    machine("cuda")
    load_config("rlvr_lora_zero3", [FULL, QUANTIZED, "num_gpus_per_node=2"], check_files=False)


def test_a_joined_cluster_decides_at_launch(machine):
    machine("cpu")  # not asked: the cluster's resources decide (decide_run_platform)
    load_config("rlvr_lora_zero3", [FULL, QUANTIZED, "ray.address=ray://head:1"], check_files=False)


def test_cuda_ipc_without_cuda(machine):
    expected = (
        "weight_sync.transport: cuda_ipc shares the weights through GPU memory, and this run "
        "has no CUDA GPUs (its device is cpu); use auto (object_store on one node, collective "
        "across nodes), collective or object_store"
    )
    assert problems("device=cpu", "weight_sync.transport=cuda_ipc") == [expected]
    machine("cpu")
    (line,) = problems("weight_sync.transport=cuda_ipc")
    assert line.startswith(expected) and "[device: auto is cpu here" in line
    machine("cuda")  # colocated ranks: cuda_ipc is right there
    load_config("rlvr_lora_zero3", ["weight_sync.transport=cuda_ipc"], check_files=False)


def test_seeded_chunking_under_auto_on_a_machine_without_cuda(machine):
    field = "actor_infer.strategy_args.strategy_config"
    split = [f"+{field}.enable_chunked_prefill=true", f"+{field}.max_num_batched_tokens=4096"]
    machine("cpu")
    (line,) = problems(*split)
    assert line.startswith(f"{field}.enable_chunked_prefill: true") and "[device: auto" in line
    machine("cuda")  # CUDA generators rewind: vLLM's chunking is safe there
    load_config("rlvr_lora_zero3", split, check_files=False)


def test_partly_colocated_gpus_under_auto(machine):
    layout = ["num_gpus_per_node=4", "actor_train.device_mapping=[0,1]"]
    layout.append("actor_infer.device_mapping=[1,2]")
    machine("cuda")
    (line,) = problems(*layout)
    assert line.startswith("weight_sync.transport=auto: actor_infer rank(s)")
    machine("cpu")  # CPU slots, not GPUs: the object store serves them
    load_config("rlvr_lora_zero3", layout, check_files=False)


def test_planned_device(monkeypatch, tmp_path):
    assert planned_device("cpu", None) == "cpu"
    assert planned_device("cuda", "ray://head:1") == "cuda"
    assert planned_device("auto", "ray://head:1") is None
    monkeypatch.delenv("ROLL_DS_DEVICE", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(platform.os.path, "exists", lambda path: False)  # no GPU driver files
    torch = sys.modules.pop("torch", None)
    try:
        assert planned_device("auto", None) == "cpu"  # torch is not asked
        assert "torch" not in sys.modules
    finally:
        if torch is not None:
            sys.modules["torch"] = torch
    # a `ray start` cluster on this machine: ray.init() joins it, its resources decide
    monkeypatch.undo()
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.1:6379")
    assert planned_device("auto", None) is None
    assert set(GPU_DRIVER_FILES) >= {"/proc/driver/nvidia/version", "/dev/nvidiactl"}


def test_a_config_error_found_at_launch_exits_without_traceback(monkeypatch, capsys, tmp_path):
    """What only a joined cluster's resources show (``decide_run_platform``, once Ray is
    connected, before any actor) leaves run.py as the same config error as validation's."""
    import importlib

    from roll_ds.config import ConfigError, compose_config
    from roll_ds.config.compose import PROJECT_ROOT
    from roll_ds.pipeline import launch

    problem = "weight_sync.transport: cuda_ipc shares the weights through GPU memory, ..."

    def refuse(cfg):
        raise ConfigError([problem])

    monkeypatch.setattr(launch, "run_pipeline", refuse)
    monkeypatch.chdir(PROJECT_ROOT)  # the default config's data paths
    examples = PROJECT_ROOT / "examples" / "qwen_rlvr"
    argv = ["run.py", "--config-path", str(examples), "--config-name", "rlvr_lora_zero3"]
    argv.append(f"hydra.run.dir={tmp_path}")
    monkeypatch.setattr(sys, "argv", [*argv, "hydra.output_subdir=null"])
    run = importlib.import_module("run")
    with pytest.raises(SystemExit) as exit_:
        run.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"roll_ds: invalid config (1 problem(s)):\n  - {problem}\n"
    compose_config("rlvr_lora_zero3")  # Hydra is left as it was
