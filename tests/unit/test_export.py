"""roll_ds.export without DeepSpeed processes: the config section, what a checkpoint records, the
atomic directories, and the converter on ZeRO-0-layout checkpoints (the module state saved as is;
the ZeRO-3 shards are covered by tests/integration/test_export_hf.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roll_ds.checkpoint import COMPLETE, LATEST, STATE_FILE
from roll_ds.config import load_config
from roll_ds.export import (
    ExportInfo,
    begin_dir,
    convert_checkpoint,
    hf_step_dir,
    locate_checkpoint,
    main,
    publish_dir,
)
from roll_ds.models.shipped import EMBEDDED_MODEL, resolve_pretrain

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target": "all-linear"}
ATOL = 1e-5  # fp32 logits, same weights, merged vs unmerged LoRA


def test_export_section_defaults_and_override():
    cfg = load_config("rlvr_lora_zero3", check_files=False)
    assert (cfg.export.at_end, cfg.export.every_save) == (True, False)
    cfg = load_config("rlvr_lora_zero3", ["export.every_save=true"], check_files=False)
    assert cfg.export.every_save is True


def test_export_info_records_base_and_lora(tmp_path):
    cfg = load_config("rlvr_lora_zero3", check_files=False)
    model_dir = resolve_pretrain(cfg.pretrain)
    info = ExportInfo.from_config(cfg, model_dir)
    assert info.base_model == EMBEDDED_MODEL
    assert info.lora == LORA | {"rank": 16, "alpha": 32}
    assert (info.dtype, info.role, info.tag) == ("fp32", "actor_train", "engine")
    info.save(tmp_path)
    assert ExportInfo.load(tmp_path) == info
    assert info.base_dir() == model_dir  # the embedded name resolves on this machine
    full = ExportInfo.from_config(load_config("rlvr_full_zero3", check_files=False), model_dir)
    assert full.lora is None


def test_missing_export_info_says_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="base model and LoRA settings"):
        ExportInfo.load(tmp_path)


def test_publish_replaces_a_directory_whole(tmp_path):
    final = hf_step_dir(tmp_path, 7)
    assert final == tmp_path / "hf" / "step_000007"
    stale = begin_dir(final)
    (stale / "half_written").write_text("x")
    partial = begin_dir(final)  # an interrupted export's leftovers are gone
    assert list(partial.iterdir()) == []
    (partial / "a").write_text("1")
    publish_dir(partial, final)
    partial = begin_dir(final)
    (partial / "b").write_text("2")
    publish_dir(partial, final)  # a step exported again replaces the old directory
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in final.parent.iterdir()) == ["step_000007"]


# ---------------------------------------------------------------------------------------------
# the converter on ZeRO-0-layout checkpoints


def _policy(lora: bool):
    """The embedded model (LoRA-wrapped, with a non-zero adapter) standing for a trained one."""
    from roll_ds.models.loading import apply_lora, load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(resolve_pretrain(EMBEDDED_MODEL))
    if lora:
        model = apply_lora(model, **LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and (not lora or "lora_B" in name):
                p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _fake_checkpoint(root: Path, model, lora: bool, step: int = 2) -> Path:
    """A pipeline checkpoint whose engine was ZeRO-0: DeepSpeed keeps the module state (under
    LoRA only the trainable parameters) in ``mp_rank_00_model_states.pt``."""
    ckpt = root / f"step_{step:06d}"
    engine = ckpt / "actor_train" / "engine"
    engine.mkdir(parents=True)
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if not lora:
        state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"module": state}, engine / "mp_rank_00_model_states.pt")
    info = ExportInfo(
        base_model=EMBEDDED_MODEL,
        base_model_path="/nowhere",
        lora=LORA if lora else None,
    )
    info.save(ckpt)
    (ckpt / STATE_FILE).write_text(json.dumps({"step": step}))
    (ckpt / COMPLETE).write_text("")
    (root / LATEST).write_text(ckpt.name)
    return ckpt


def _probe() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model.eval()(**_probe()).logits


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_convert_checkpoint_gives_the_trained_logits(tmp_path, lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _policy(lora)
    want = _logits(model)
    _fake_checkpoint(tmp_path / "checkpoints", model, lora)
    out = tmp_path / "hf"
    written = convert_checkpoint(tmp_path / "checkpoints", out)  # the newest checkpoint
    assert written["model"] == str(out)
    files = sorted(p.name for p in out.iterdir())
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert name in files, files
    assert not list(tmp_path.glob("*.partial"))
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (_logits(plain) - want).abs().max().item() <= ATOL
    base = AutoModelForCausalLM.from_pretrained(resolve_pretrain(EMBEDDED_MODEL))
    assert (_logits(base) - want).abs().max().item() > 0.1  # the checkpoint's weights count
    assert AutoTokenizer.from_pretrained(out).eos_token_id == plain.config.eos_token_id == 258
    assert ("adapter" in written) == lora


def test_adapter_only_loads_with_peft_on_the_base(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _policy(lora=True)
    want = _logits(model)
    ckpt = _fake_checkpoint(tmp_path / "checkpoints", model, lora=True)
    out = tmp_path / "adapter"
    assert main([str(ckpt), "--out", str(out), "--adapter-only"]) == 0
    assert "adapter written to" in capsys.readouterr().out
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    # the base as configured, not the install's directory it was loaded from
    recorded = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == EMBEDDED_MODEL == "embedded:tiny-qwen2"
    base = AutoModelForCausalLM.from_pretrained(resolve_pretrain(EMBEDDED_MODEL))
    served = PeftModel.from_pretrained(base, out)
    assert (_logits(served) - want).abs().max().item() <= ATOL


def test_converter_errors_name_the_problem(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    ckpt = _fake_checkpoint(tmp_path / "checkpoints", _policy(lora=False), lora=False)
    assert main([str(ckpt), "--out", str(tmp_path / "o"), "--adapter-only"]) == 2
    assert "no adapter" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    assert main([str(ckpt), "--out", str(tmp_path / "busy")]) == 2
    assert "not empty" in capsys.readouterr().err
    (ckpt / COMPLETE).unlink()
    with pytest.raises(FileNotFoundError, match="not a complete"):
        locate_checkpoint(ckpt)


def test_converter_imports_without_ray_or_deepspeed():
    code = (
        "import sys, roll_ds.export\n"
        "print([m for m in ('ray', 'deepspeed', 'vllm') if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"
