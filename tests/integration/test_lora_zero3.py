"""LoRA (peft, all-linear) under ZeRO-3 on 2 CPU ranks, with the frozen base partitioned and kept
whole (``zero3_frozen_base``), the adapter partitioned by ZeRO-3 or replicated by the stage-1
engine a whole base gets by default, or a stage-2 one (``zero3_adapter_stage``): only the
adapter trains, the adapter-disabled engine is the base model, and merged weights (sync
buckets, HF export) reproduce the trained policy in plain transformers / peft."""

from __future__ import annotations

import os

import pytest
from _dist import run_distributed
from _train_helpers import make_strategy, nll_loss, rank_batch

pytestmark = pytest.mark.integration

BUCKET_BYTES = 100_000
ATOL = 1e-5  # fp32 log-probs, same weights, different kernels / gathers


def _gathered_copy(module, trainable: bool) -> dict:
    import deepspeed

    from roll_ds.models.frozen_base import named_weights

    named = [(n, p) for n, p in named_weights(module) if p.requires_grad == trainable]
    zero3 = [p for _, p in named if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(zero3, enabled=bool(zero3)):
        return {n: p.detach().clone() for n, p in named}


def _placement(module, world_size: int) -> dict:
    """Frozen base weights that are ZeRO-3 parameters / whole buffers, adapter parameters
    holding just their shard."""
    from roll_ds.models.frozen_base import count_frozen_whole, named_weights

    frozen = [t for _, t in named_weights(module) if not t.requires_grad]
    adapter = [p for p in module.parameters() if p.requires_grad]
    return {
        "frozen_partitioned": sum(hasattr(t, "ds_id") for t in frozen),
        "frozen_whole": count_frozen_whole(module),
        "frozen_total": len(frozen),
        "adapter_sharded": sum(
            hasattr(p, "ds_id")
            and p.numel() == 0
            and p.ds_tensor.numel() == -(-p.ds_numel // world_size)
            for p in adapter
        ),
        "adapter_total": len(adapter),
    }


def _hf_logprobs(path_or_model, batch):
    from transformers import AutoModelForCausalLM

    from strategies._common import forward_logprobs

    model = path_or_model
    if isinstance(path_or_model, str):
        model = AutoModelForCausalLM.from_pretrained(path_or_model, dtype="float32")
    model.eval()
    import torch

    with torch.no_grad():
        return forward_logprobs(model, batch["input_ids"], batch["attention_mask"])["logprobs_BT"]


def _lora_checks(model_path: str, out_dir: str, frozen_base: str, adapter_stage) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    s = make_strategy(
        model_path,
        3,
        zero={"stage3_param_persistence_threshold": 0},
        ds_extra={"zero3_frozen_base": frozen_base, "zero3_adapter_stage": adapter_stage},
        lora_rank=4,
        lora_alpha=8,
        learning_rate=1e-2,
        seed=0,
    )
    res: dict = {}
    trainable = [n for n, p in s.module.named_parameters() if p.requires_grad]
    res["trainable_all_lora"] = bool(trainable) and all(".lora_" in n for n in trainable)
    res["lora_modules"] = len(trainable) // 2
    res["placement"] = _placement(s.module, s.world_size)
    res["engine_stage"] = s.engine.zero_optimization_stage()
    # Sync before training: the adapter's B is zero, so the merged weights are the checkpoint's.
    synced = {n: t for b in s.named_weights_for_sync(BUCKET_BYTES) for n, t in b}
    source = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32").state_dict()
    res["sync_before_training_exact"] = synced.keys() == source.keys() and all(
        torch.equal(synced[n].cpu(), source[n]) for n in source
    )

    base_before = _gathered_copy(s.module, trainable=False)
    lora_before = _gathered_copy(s.module, trainable=True)
    batch = rank_batch(s.rank)
    res["losses"] = [s.train_step(batch, nll_loss)["loss"] for _ in range(3)]
    base_after = _gathered_copy(s.module, trainable=False)
    lora_after = _gathered_copy(s.module, trainable=True)
    res["base_bit_identical"] = all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    res["lora_changed"] = sum(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)
    res["lora_total"] = len(lora_before)

    probe = rank_batch(0, seed=7)  # the same rows on both ranks
    reference = s.compute_logprobs(
        probe["input_ids"], probe["attention_mask"], disable_adapter=True
    )
    policy = s.compute_logprobs(probe["input_ids"], probe["attention_mask"])["logprobs_BT"]
    base = _hf_logprobs(model_path, probe)
    res["reference_vs_base"] = (reference["logprobs_BT"] - base).abs().max().item()
    res["policy_vs_base"] = (policy - base).abs().max().item()

    # Sync buckets: bounded size, LoRA merged into HF names, tied head present.
    weights, oversize = {}, 0
    for bucket in s.named_weights_for_sync(BUCKET_BYTES):
        unique = {id(t): t for _, t in bucket}.values()
        if len(unique) > 1 and sum(t.numel() * t.element_size() for t in unique) > BUCKET_BYTES:
            oversize += 1
        weights.update(bucket)
    res["oversize_buckets"] = oversize
    res["has_lm_head"] = "lm_head.weight" in weights
    res["lora_names_leaked"] = [n for n in weights if "lora_" in n or "base_layer" in n]
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32")
    plain.load_state_dict(weights, strict=True)
    res["merged_sync_vs_policy"] = (_hf_logprobs(plain, probe) - policy).abs().max().item()

    written = s.export_hf(out_dir)
    if s.rank == 0:
        exported = _hf_logprobs(written["model"], probe)
        res["export_merged_vs_policy"] = (exported - policy).abs().max().item()
        base_model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32")
        adapter = PeftModel.from_pretrained(base_model, written["adapter"])
        res["export_adapter_vs_policy"] = (_hf_logprobs(adapter, probe) - policy).abs().max().item()
        res["export_files"] = sorted(os.listdir(out_dir))
    s.close()
    return res


CASES = [
    ("partitioned", "auto", 3),
    ("whole", 3, 3),
    ("whole", 2, 2),
    ("whole", "auto", 1),
]


def check_lora_results(results: list, frozen_base: str, engine_stage: int, atol: float) -> None:
    """The assertions on every rank's ``_lora_checks`` (also run on GPUs, ``test_gpu_path``,
    where ``atol`` allows for CUDA kernels against the CPU reference forward)."""
    for rank, res in enumerate(results):
        assert res["trainable_all_lora"], res
        assert res["lora_modules"] == 2 * 7  # all-linear: q k v o gate up down, 2 layers
        where = res["placement"]
        assert res["engine_stage"] == engine_stage, res
        assert where["adapter_total"] == 2 * 2 * 7, where
        assert where["adapter_sharded"] == (where["adapter_total"] if engine_stage == 3 else 0)
        whole = frozen_base == "whole"
        assert where["frozen_whole"] == (where["frozen_total"] if whole else 0), where
        assert where["frozen_partitioned"] == (0 if whole else where["frozen_total"]), where
        assert res["sync_before_training_exact"], f"rank {rank}: sync differs from the checkpoint"
        assert res["base_bit_identical"], f"rank {rank}: frozen base weights moved"
        assert res["lora_changed"] == res["lora_total"], res
        assert res["losses"][-1] < res["losses"][0], res["losses"]
        assert res["reference_vs_base"] <= atol, res
        assert res["policy_vs_base"] > 1e-3, "training did not move the adapter-enabled policy"
        assert res["oversize_buckets"] == 0 and res["has_lm_head"], res
        assert res["lora_names_leaked"] == [], res
        assert res["merged_sync_vs_policy"] <= atol, res
    root = results[0]
    assert root["export_merged_vs_policy"] <= atol, root
    assert root["export_adapter_vs_policy"] <= atol, root
    assert "model.safetensors" in root["export_files"] and "config.json" in root["export_files"]


def _case(frozen_base: str, adapter_stage) -> str:
    return f"{frozen_base}-{adapter_stage}"


def _lora_cases(model_path: str, out_dir: str, cases: list) -> dict:
    """``_lora_checks`` of every case, one after another in this process group."""
    out = {}
    for frozen_base, adapter_stage, _ in cases:
        name = _case(frozen_base, adapter_stage)
        try:
            export = os.path.join(out_dir, name)
            out[name] = _lora_checks(model_path, export, frozen_base, adapter_stage)
        except Exception as err:
            raise RuntimeError(f"case {name}") from err  # the traceback names the case
    return out


@pytest.fixture(scope="module")
def lora_results(tiny_qwen2_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's ``_lora_checks``, one per rank. The cases share one 2-rank process group
    (as test_zero_parity.py's stages do): a group of its own per case started 2 ranks, each
    importing torch and DeepSpeed, 4 times (~15 s a case)."""
    out = tmp_path_factory.mktemp("lora_exports")
    ranks = run_distributed(
        _lora_cases, world_size=2, args=(tiny_qwen2_dir, str(out), CASES), timeout_s=1000
    )
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


@pytest.mark.parametrize(("frozen_base", "adapter_stage", "engine_stage"), CASES)
def test_lora_under_zero3(lora_results, frozen_base, adapter_stage, engine_stage):
    results = lora_results[_case(frozen_base, adapter_stage)]
    check_lora_results(results, frozen_base, engine_stage, ATOL)


def _resume_across_adapter_stages(model_path: str, ckpt: str) -> dict:
    saver = make_strategy(model_path, 3, ds_extra={"zero3_adapter_stage": 3}, lora_rank=4)
    saver.train_step(rank_batch(saver.rank), nll_loss)
    saver.save_checkpoint(ckpt, "step1")
    saver.close()
    out = {}
    for name, extra in (("auto", {}), ("stage3", {"zero3_adapter_stage": 3})):
        s = make_strategy(model_path, 3, ds_extra=extra, lora_rank=4)
        try:
            s.load_checkpoint(ckpt, "step1")
            out[name] = f"loaded at step {s.global_step}"
        except ValueError as exc:
            out[name] = str(exc)
        s.close()
    return out


def test_a_checkpoint_refuses_an_engine_of_another_stage_with_the_fix(tiny_qwen2_dir, tmp_path):
    """Saved with the adapter at ZeRO-3, loaded by the default's stage-1 engine: the error names
    the key and value to resume with (DeepSpeed alone fails with a bare AssertionError)."""
    results = run_distributed(
        _resume_across_adapter_stages,
        world_size=2,
        args=(tiny_qwen2_dir, str(tmp_path / "ckpt")),
        timeout_s=300,
    )
    for res in results:
        assert "saved by a ZeRO stage-3 engine, but this run builds a stage-1 engine" in res["auto"]
        assert "zero3_adapter_stage: 3" in res["auto"], res
        assert res["stage3"] == "loaded at step 1", res
