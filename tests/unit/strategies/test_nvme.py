"""NVMe offload's checks (strategies/deepspeed/nvme.py): the swap directory, its room, the file
system, libaio, and the sizes read from safetensors headers; each bad input a clear error naming
the field, before any actor starts (``load_config`` runs them)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections import namedtuple
from pathlib import Path

import pytest

from roll_ds.config import ConfigError, load_config
from roll_ds.config.deepspeed import role_nvme_dir
from roll_ds.models.shipped import resolve_embedded
from strategies.deepspeed import nvme

FIELD = "actor_train.strategy_args.strategy_config.zero_optimization.offload_param.nvme_path"
GIB = 2**30
Usage = namedtuple("Usage", "total used free")


def _nvme_run(tmp_path, *overrides: str):
    """The default RLVR config (embedded model, full fine-tuning) on the NVMe preset."""
    return load_config(
        "rlvr_lora_zero3",
        [
            "actor_train.strategy_args.strategy_config=${deepspeed_zero3_nvme}",
            "actor_train.model_args.lora_rank=null",
            f"output_dir={tmp_path / 'out'}",
            *overrides,
        ],
    )


def _at(path) -> str:
    return f"deepspeed_zero3_nvme.zero_optimization.offload_param.nvme_path={path}"


def _fake_free(monkeypatch, free: int) -> None:
    """The free-space reading of every path (the kernel's answer is the boundary faked)."""
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda path: Usage(free * 2, free, free))


def test_swap_bytes_by_hand():
    # bf16 parameters: 2 bytes each; the optimizer: 16 bytes per trained parameter
    both = ("offload_param", "offload_optimizer")
    assert nvme.swap_bytes(both, numel=1000, trained_numel=1000, dtype="bf16") == 18_000
    assert nvme.swap_bytes(both, numel=1000, trained_numel=10, dtype="fp32") == 4_160
    assert nvme.swap_bytes(["offload_param"], numel=1000, trained_numel=0, dtype="fp32") == 4000
    # two nodes, 3 of the role's 4 ranks on this one
    assert nvme.swap_bytes(both, numel=400, trained_numel=400, dtype="bf16", share=0.75) == 5400


def _safetensors(path, tensors: dict[str, list[int]]) -> None:
    """A safetensors file with these shapes (bf16, zero data): only the header is read."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 2 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_model_size_and_adapter_from_headers(tmp_path):
    _safetensors(
        tmp_path / "model.safetensors",
        {
            "model.embed_tokens.weight": [100, 8],
            "model.layers.0.self_attn.q_proj.weight": [8, 8],
            "model.layers.0.self_attn.v_proj.weight": [4, 8],
            "model.layers.0.mlp.up_proj.weight": [16, 8],
            "model.layers.0.input_layernorm.weight": [8],
            "lm_head.weight": [100, 8],
        },
    )
    size = nvme.model_size(str(tmp_path))
    assert size.numel == 800 + 64 + 32 + 128 + 8 + 800
    assert size.largest_numel == 800
    # rank 2: q (8+8), v (8+4), up (8+16); embeddings, lm_head and norms are not adapted
    assert size.adapter_numel(2, "all-linear") == 2 * (16 + 12 + 24)
    assert size.adapter_numel(2, "q_proj,v_proj") == 2 * (16 + 12)
    assert nvme.model_size(str(tmp_path / "none")) is None


def test_model_size_of_the_embedded_model():
    path = resolve_embedded("embedded:tiny-qwen2")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    size = nvme.model_size(path)
    hidden = config["hidden_size"]
    largest = max(config["vocab_size"], config["intermediate_size"]) * hidden
    assert size.largest_numel == largest
    assert size.numel > size.largest_numel


def test_nvme_preset_validates_and_auto_is_the_roles_directory(tmp_path):
    cfg = _nvme_run(tmp_path)
    zero = cfg.actor_train.strategy_args.strategy_config["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == "auto"
    assert role_nvme_dir(str(tmp_path / "out"), "rlvr_lora_zero3", "actor_train") == str(
        tmp_path / "out" / "rlvr_lora_zero3" / "nvme" / "actor_train"
    )
    assert not (tmp_path / "out").exists()  # validation creates nothing


def test_nvme_path_whose_parent_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = blocker / "swap"
    with pytest.raises(ConfigError) as err:
        _nvme_run(tmp_path, _at(path))
    assert f"{FIELD}: {path} cannot be created: {blocker} is a file" in str(err.value)


def test_nvme_path_missing_but_creatable_is_fine(tmp_path):
    path = tmp_path / "not" / "yet" / "there"
    _nvme_run(tmp_path, _at(path))
    assert not path.exists()


def test_read_only_nvme_path(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes through mode bits: read them, as a user's access would
        monkeypatch.setattr(nvme, "_writable", lambda p: bool(os.stat(p).st_mode & 0o200))
    try:
        for path, what in ((ro, "is not writable"), (ro / "sub", f"cannot be created ({ro} is")):
            with pytest.raises(ConfigError) as err:
                _nvme_run(tmp_path, _at(path))
            assert f"{FIELD}: {path} {what}" in str(err.value)
            assert "choose a writable directory" in str(err.value)
    finally:
        ro.chmod(0o755)


def test_nvme_path_on_tmpfs_warns(tmp_path, caplog):
    if nvme.filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    path = "/dev/shm/roll_ds_nvme_test/swap"
    with caplog.at_level(logging.WARNING):
        _nvme_run(tmp_path, _at(path))
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"{FIELD}: {path} is on tmpfs, which is memory" in line for line in lines), lines


def test_file_system_without_direct_io(tmp_path, monkeypatch):
    assert nvme._direct_io(tmp_path)  # a local disk here
    assert list(tmp_path.iterdir()) == []  # the probe file is removed
    monkeypatch.setattr(nvme, "_direct_io", lambda directory: False)
    with pytest.raises(ConfigError) as err:
        _nvme_run(tmp_path, _at(tmp_path / "swap"))
    assert f"{FIELD}: {tmp_path / 'swap'} is on a file system that refuses O_DIRECT" in str(
        err.value
    )


def test_too_small_at_the_boundary(tmp_path, monkeypatch):
    path = resolve_embedded("embedded:tiny-qwen2")
    numel = nvme.model_size(path).numel
    # fp32 full fine-tuning, both sections in one directory, one node: 4 + 16 bytes a parameter
    need = numel * (4 + 16)
    _fake_free(monkeypatch, need)
    _nvme_run(tmp_path)  # exactly enough
    _fake_free(monkeypatch, need - 1)
    with pytest.raises(ConfigError) as err:
        _nvme_run(tmp_path)
    message = str(err.value)
    auto = role_nvme_dir(str(tmp_path / "out"), "rlvr_lora_zero3", "actor_train")
    # both sections share the auto directory: one problem, named by the first
    field = FIELD.replace("offload_param", "offload_optimizer")
    assert f"{field}: {auto} has {(need - 1) / GIB:.2f} GiB free" in message
    assert f"swaps about {need / GIB:.2f} GiB there" in message


def test_lora_needs_room_for_the_adapters_optimizer_only(tmp_path, monkeypatch):
    size = nvme.model_size(resolve_embedded("embedded:tiny-qwen2"))
    need = size.numel * 4 + size.adapter_numel(16, "all-linear") * 16
    _fake_free(monkeypatch, need)
    overrides = ("actor_train.model_args.lora_rank=16",)
    _nvme_run(tmp_path, *overrides)
    _fake_free(monkeypatch, need - 1)
    with pytest.raises(ConfigError, match="swaps about"):
        _nvme_run(tmp_path, *overrides)


def test_without_libaio_the_error_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "libaio_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        _nvme_run(tmp_path)
    message = str(err.value)
    assert "actor_train.strategy_args.strategy_config: NVMe offload needs libaio" in message
    assert "install libaio-dev" in message
    # a run that does not ask for NVMe does not need it
    load_config("rlvr_lora_zero3", [f"output_dir={tmp_path}"])


def test_libaio_probe_fails_without_a_compiler_that_links(monkeypatch):
    monkeypatch.setenv("CC", "false")
    assert nvme.libaio_available() is False


@pytest.mark.skipif(not os.path.exists("/usr/include/libaio.h"), reason="libaio-dev missing")
def test_libaio_probe_finds_an_installed_libaio():
    assert shutil.which("cc") is not None
    assert nvme.libaio_available() is True


def test_nvme_path_must_be_a_path():
    from roll_ds.config.deepspeed import check_deepspeed_config

    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    (problem,) = check_deepspeed_config(ds, "x")
    assert problem.startswith("x.zero_optimization.offload_param.nvme_path: NVMe offload needs")


def test_each_rank_checks_its_share_before_its_engine(tmp_path, monkeypatch):
    """A rank's built config (nvme_path resolved): room for its 1/dp_size share, or a
    ValueError naming the key."""
    built = _built_nvme_preset(tmp_path)
    size = nvme.ModelSize(numel=1000, largest_numel=100)
    share = (1000 * 2 + 1000 * 16) // 2  # bf16 parameters, full fine-tuning, half on this rank
    check = dict(size=size, trained_numel=None, dtype="bf16", dp_size=2)
    _fake_free(monkeypatch, share)
    nvme.check_rank_nvme(built, **check)
    _fake_free(monkeypatch, share - 1)
    with pytest.raises(ValueError, match=r"strategy_config\.zero_optimization\.offload_optimizer"):
        nvme.check_rank_nvme(built, **check)


def test_ranks_of_one_node_need_room_for_all_their_shares(tmp_path, monkeypatch):
    """Both ranks of a 2-rank role swap onto the same disk (as the role's process group
    reports): the disk needs room for both shares, not one (the check counted one rank's)."""
    built = _built_nvme_preset(tmp_path)
    # the process group is the boundary: every rank reports the disk of its copy of each path
    monkeypatch.setattr(nvme, "_gather_disk_ids", lambda mine: [mine, mine], raising=False)
    size = nvme.ModelSize(numel=2**28, largest_numel=100)
    node = 2**28 * (2 + 16)  # bf16 parameters, full fine-tuning, both ranks' halves: 4.5 GiB
    check = dict(size=size, trained_numel=None, dtype="bf16", dp_size=2)
    _fake_free(monkeypatch, node // 2)  # one rank's half: was enough before
    with pytest.raises(ValueError) as info:
        nvme.check_rank_nvme(built, **check)
    message = str(info.value)
    assert "strategy_config.zero_optimization.offload_optimizer.nvme_path" in message
    assert "has 2.25 GiB free" in message and "swaps about 4.50 GiB there on this node" in message
    _fake_free(monkeypatch, node)
    nvme.check_rank_nvme(built, **check)


def test_disk_peers_counts_the_ranks_on_this_rank_s_disk(tmp_path, monkeypatch):
    """Another host's rank, or one whose copy of the path is on another device, is not a peer."""
    here = nvme.disk_id(str(tmp_path))
    others = [[here], [("another-host", here[1])], [(here[0], here[1] + 1)], [here]]
    monkeypatch.setattr(nvme, "_gather_disk_ids", lambda mine: others)
    assert nvme.disk_peers([str(tmp_path / "not" / "yet")]) == [2]


def test_nvme_dir_that_looks_writable_but_takes_no_file(tmp_path, monkeypatch):
    """Mode bits that allow writing do not mean a file can be created (root on sysfs, an ACL,
    NFS mapping the user to nobody): validation creates one, and a refusal is a problem naming
    the key, not a PermissionError traceback."""
    if os.geteuid() == 0:  # root passes every mode check; sysfs still takes no new file
        locked = Path("/sys/kernel")
        if not os.access(locked, os.W_OK | os.X_OK):
            pytest.skip("/sys/kernel is not writable by mode here")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        monkeypatch.setattr(nvme, "_writable", lambda directory: True)  # what an ACL says
    path = locked / "roll_ds_swap"
    try:
        with pytest.raises(ConfigError) as err:
            _nvme_run(tmp_path, _at(path))
    finally:
        if locked.is_relative_to(tmp_path):
            locked.chmod(0o755)
    assert (
        f"{FIELD}: {path}: no file can be created in {locked} (Permission denied), though it "
        "looks writable; choose a directory on a local NVMe drive" in str(err.value)
    )


def test_nvme_path_under_dev_warns_it_is_memory(tmp_path, caplog):
    if nvme.filesystem_type("/dev") != "devtmpfs" or not os.access("/dev", os.W_OK):
        pytest.skip("/dev is not a writable devtmpfs here")
    path = "/dev/roll_ds_nvme_test/swap"
    with caplog.at_level(logging.WARNING):
        _nvme_run(tmp_path, _at(path))
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"{FIELD}: {path} is on devtmpfs, which is memory" in line for line in lines), lines
    assert not os.path.exists("/dev/roll_ds_nvme_test")  # validation creates nothing there


BUFFER = "zero_optimization.offload_param.buffer_size"


def problems(*overrides: str) -> list[str]:
    """The problems of the default config with ``overrides``, files not read (the embedded
    model's sizes are package data and still are)."""
    with pytest.raises(ConfigError) as err:
        load_config("rlvr_lora_zero3", list(overrides), check_files=False)
    return err.value.problems


@pytest.mark.parametrize("size", ["1e15", "10"])
def test_absurd_swap_buffer_size(size):
    found = problems(
        "actor_train.strategy_args.strategy_config=${deepspeed_zero3_nvme}",
        f"deepspeed_zero3_nvme.{BUFFER}={size}",
    )
    embedded = nvme.model_size(resolve_embedded("embedded:tiny-qwen2"))
    low = -(-embedded.largest_numel // 2)  # the largest parameter over actor_train's 2 ranks
    (line,) = [p for p in found if BUFFER in p]
    assert line.startswith(
        f"actor_train.strategy_args.strategy_config.{BUFFER}: {float(size):,.0f} elements is "
        f"outside what can work, [{low:,}, "
    ), line
    assert "set it to auto (the largest partition) or a number in that range" in line


def test_absurd_aio_block_size():
    found = problems(
        "actor_train.strategy_args.strategy_config=${deepspeed_zero3_nvme}",
        "deepspeed_zero3_nvme.aio.block_size=1000000000000",
    )
    assert found == [
        "actor_train.strategy_args.strategy_config.aio.block_size: 1,000,000,000,000 bytes per "
        "I/O request is outside a sane range, [4,096, 1,073,741,824] (DeepSpeed's default "
        "1,048,576; its ds_nvme_tune measures the best value for a drive)"
    ]


def _built_nvme_preset(tmp_path):
    """The NVMe preset as a rank of a 2-rank bf16 role builds it (nvme_path resolved)."""
    import yaml

    from roll_ds.config.compose import PROJECT_ROOT
    from roll_ds.config.deepspeed import DeepSpeedInputs, build_deepspeed_config

    text = (PROJECT_ROOT / "examples" / "config" / "deepspeed_zero3_nvme.yaml").read_text()
    return build_deepspeed_config(
        yaml.safe_load(text)["deepspeed_zero3_nvme"],
        DeepSpeedInputs(
            micro_batch_size=1,
            gradient_accumulation_steps=1,
            dp_size=2,
            max_grad_norm=1.0,
            dtype="bf16",
            nvme_dir=str(tmp_path / "actor_train"),
            largest_numel=100,
        ),
    )
