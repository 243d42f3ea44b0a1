"""An ``optimizer`` section in the DeepSpeed config whose op cannot be built here (an image
without nvcc or DeepSpeed's prebuilt ops): Adam / AdamW fall back to torch's optimizer with the
section's params, with a warning naming the op and why, instead of failing at start. The op is
made unavailable at the boundary: DeepSpeed's op builder, whose ``load`` raises as a failed JIT
build does. The last test builds a real engine (one gloo rank, in a child process)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from deepspeed.ops import op_builder

from strategies.deepspeed.optimizer import section_fallback, section_op

REPO = Path(__file__).resolve().parents[3]
NO_NVCC = "MissingCUDAException: nvcc not found; CUDA_HOME does not exist"


class UnbuildableOp:
    def load(self):
        raise RuntimeError(NO_NVCC)


class BuiltOp:
    loaded = 0

    def load(self):
        BuiltOp.loaded += 1
        return object()


def ds_config(kind: str = "AdamW", offload: str | None = None, **params) -> dict:
    zero = {"stage": 2}
    if offload is not None:
        zero["offload_optimizer"] = {"device": offload}
    params = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, **params}
    return {"zero_optimization": zero, "optimizer": {"type": kind, "params": params}}


@pytest.mark.parametrize(
    ("cfg", "op"),
    [
        (ds_config(), "FusedAdamBuilder"),
        (ds_config("Adam"), "FusedAdamBuilder"),
        (ds_config(offload="cpu"), "CPUAdamBuilder"),
        (ds_config(offload="nvme"), "CPUAdamBuilder"),
        (ds_config(offload="none"), "FusedAdamBuilder"),
        (ds_config(torch_adam=True), None),
        (ds_config("Lamb"), None),
    ],
)
def test_the_op_deepspeed_builds_for_a_section(cfg, op):
    assert section_op(cfg) == op


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_an_unbuildable_op_switches_the_section_to_torch_with_a_warning(
    monkeypatch, caplog, offload
):
    cfg = ds_config(offload=offload)
    op = section_op(cfg)
    monkeypatch.setattr(op_builder, op, UnbuildableOp)
    with caplog.at_level(logging.WARNING, logger="strategies.deepspeed.optimizer"):
        section_fallback(cfg)
    assert cfg["optimizer"]["params"] == {**ds_config()["optimizer"]["params"], "torch_adam": True}
    assert (cfg.get("zero_force_ds_cpu_optimizer") is False) == (offload == "cpu")
    (record,) = caplog.records
    assert op in record.getMessage() and "nvcc not found" in record.getMessage()


def test_a_buildable_op_leaves_the_section_alone(monkeypatch):
    monkeypatch.setattr(op_builder, "FusedAdamBuilder", BuiltOp)
    cfg = ds_config()
    section_fallback(cfg)
    assert cfg == ds_config() and BuiltOp.loaded == 1  # built once, cached for DeepSpeed


def test_a_param_torch_does_not_take_fails_at_start_naming_it(monkeypatch):
    monkeypatch.setattr(op_builder, "FusedAdamBuilder", UnbuildableOp)
    with pytest.raises(ValueError, match=r"nvcc not found.*params\.bias_correction"):
        section_fallback(ds_config(bias_correction=True))


ENGINE = textwrap.dedent(
    """
    import importlib, json, os, sys, tempfile
    import torch, torch.distributed as dist
    from deepspeed.ops import op_builder
    from deepspeed.ops.adam import fused_adam

    class UnbuildableOp:
        def load(self):
            raise RuntimeError("nvcc not found")

    # the builder by both names: DeepSpeed's op registry and FusedAdam's constructor
    op_builder.FusedAdamBuilder = fused_adam.FusedAdamBuilder = UnbuildableOp
    # Nor its CPU shared-memory all-reduce op, which init_distributed JIT-builds (70-130 s when
    # the extension cache is cold or was built by another venv): one rank reduces nothing, and
    # plain gloo is what the engine then uses.
    # (the module by its full name: deepspeed.comm's attribute "torch" is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                            world_size=1)
    from roll_ds.config.schema import TrainingArgs
    from strategies.deepspeed.optimizer import build_engine

    ds = json.loads(sys.argv[1])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, _, _ = build_engine(model, ds, TrainingArgs(weight_decay=0.0), max_steps=2)
    opt = engine.basic_optimizer
    if engine.zero_optimization_stage():  # a step reduces gradients (DeepSpeed's Muon check)
        loss = engine(torch.randn(1, 4)).sum()
        engine.backward(loss)
        engine.step()
    muon = [sys.modules.get("deepspeed.runtime.zero.muon." + m)
            for m in ("muon_optimizer", "original_muon")]
    print(json.dumps({"type": type(opt).__name__, "lr": opt.defaults["lr"],
                      "betas": list(opt.defaults["betas"]), "eps": opt.defaults["eps"],
                      "weight_decay": opt.param_groups[0]["weight_decay"],
                      "muon_imported": any(m is not None and not hasattr(m, "__roll_ds__")
                                           for m in muon),
                      "zero_stage": engine.zero_optimization_stage()}))
    """
)


def build_in_subprocess(cfg: dict) -> dict:
    env = {"PYTHONPATH": str(REPO), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", ENGINE, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_zero_engine_starts_and_steps_without_importing_deepspeed_s_muon():
    """ZeRO's optimizer-type check and its gradient reduction import DeepSpeed's Muon module,
    which compiles kernels at import (2-3 s of each trainer rank); our AdamW needs neither
    (``skip_muon_import``): the engine starts and takes a step with the stand-in."""
    cfg = {
        "zero_optimization": {"stage": 1},
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
    }
    got = build_in_subprocess(cfg)
    assert got["type"] == "AdamW" and got["zero_stage"] == 1
    assert got["muon_imported"] is False


def test_deepspeed_builds_torch_adamw_from_the_section_when_fused_adam_cannot_build():
    """Without the fallback, deepspeed.initialize raised FusedAdam's build error here. The
    section's weight decay (0.1) is the decayed group's, not the training args' (0.0)."""
    cfg = {
        **ds_config(),
        "zero_optimization": {"stage": 0},
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
    }
    got = build_in_subprocess(cfg)
    assert got == {
        "type": "AdamW",
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "muon_imported": False,
        "zero_stage": 0,
    }
