"""benchmarks/model_size.py: the models it writes are the Qwen2 models it names, and every mode's
overrides compose into a valid config (so a long run never fails on a typo after an hour)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, Qwen2ForCausalLM

from benchmarks.model_size import FAMILIES, MODES, Family, build_model, num_params, parse_size
from roll_ds.config import load_config


@pytest.mark.parametrize("size", ["0.5b:1", "untied:2"])
def test_written_model_is_the_qwen2_it_names(tmp_path, monkeypatch, size):
    # a small stand-in for the 7B family's untied lm_head (its one layer is 0.5 GB to write)
    monkeypatch.setitem(FAMILIES, "untied", Family(64, 128, 4, 2, tie_embeddings=False))
    total = build_model(size, tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        reference = Qwen2ForCausalLM(config)
    # every parameter HF builds for that config, with its shape, and nothing else
    expected = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    written = {}
    for shard in set(index["weight_map"].values()):
        written.update({n: tuple(t.shape) for n, t in load_file(tmp_path / shard).items()})
    assert written == expected
    assert total == num_params(size) == sum(p.numel() for p in reference.parameters())
    assert config.num_hidden_layers == parse_size(size)[1]


def test_seven_b_stack_size():
    # Qwen2.5-7B's 28 layers: 6.53B parameters (its 152k-token embeddings, 1.1B, are not here)
    assert 6.5e9 < num_params("7b:28") < 6.6e9


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_overrides_compose(tmp_path, mode):
    from benchmarks.model_size import COMMON

    load_config(
        "rlvr_lora_zero3",
        [*COMMON, *MODES[mode].overrides, f"output_dir={tmp_path}", "pretrain=embedded:tiny-qwen2"],
    )


def test_bad_size_names_the_form():
    with pytest.raises(SystemExit, match="<family>:<layers>"):
        parse_size("13b:4")


def test_combine_takes_each_mode_from_the_last_sweep_that_ran_it():
    from benchmarks.model_size import combine

    def attempt(mode, size, ok, params):
        return {"mode": mode, "size": size, "ok": ok, "params": params}

    first = {
        "commands": ["sweep 1"],
        "box": "box",
        "attempts": [
            attempt("zero0_full", "a", True, 1),
            attempt("zero3_nvme_full", "b", False, 3),
        ],
        "largest_params": {"zero0_full": 1},
    }
    second = {
        "command": "sweep 2",  # a results file from before "commands"
        "box": "box",
        "attempts": [
            attempt("zero3_nvme_full", "b", True, 3),
            attempt("zero3_nvme_full", "c", False, 4),
        ],
        "largest_params": {"zero3_nvme_full": 3},
    }
    out = combine([first, second])
    assert out["commands"] == ["sweep 1", "sweep 2"]
    assert [(a["mode"], a["size"], a["ok"]) for a in out["attempts"]] == [
        ("zero0_full", "a", True),
        ("zero3_nvme_full", "b", True),
        ("zero3_nvme_full", "c", False),
    ]
    assert out["largest_params"] == {"zero0_full": 1, "zero3_nvme_full": 3}
