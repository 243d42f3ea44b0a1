"""A checkpoint saved at step k and loaded into a fresh ZeRO-3 engine continues with identical
losses (optimizer, LR schedule and RNG restored: the model uses dropout, so a wrong RNG shows);
the HF export of the resumed engine loads in plain transformers with the same logits."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from _dist import run_distributed
from _train_helpers import make_strategy, nll_loss, rank_batch

pytestmark = pytest.mark.integration

SAVE_AT, TOTAL = 2, 5
ZERO3 = {"stage3_param_persistence_threshold": 0}


def _common(lora: bool) -> dict:
    extra = dict(lora_rank=4, lora_dropout=0.1) if lora else {}
    return dict(zero=ZERO3, warmup_steps=2, lr_scheduler_type="cosine", max_steps=TOTAL, **extra)


def _train_and_save(model_path: str, ckpt: str, lora: bool) -> dict:
    a = make_strategy(model_path, 3, seed=0, **_common(lora))
    batches = [rank_batch(a.rank, seed=step) for step in range(TOTAL)]
    first = [a.train_step(b, nll_loss)["loss"] for b in batches[:SAVE_AT]]
    a.save_checkpoint(ckpt, f"step{SAVE_AT}")
    tail = [a.train_step(b, nll_loss) for b in batches[SAVE_AT:]]
    a.close()
    return {"first": first, "tail": [(m["loss"], m["lr"]) for m in tail]}


def _resume(
    model_path: str,
    ckpt: str,
    lora: bool,
    *,
    forget_rng: bool = False,
    export_dir: str | None = None,
) -> dict:
    import torch

    b = make_strategy(model_path, 3, seed=123, **_common(lora))  # state must come from disk
    b.load_checkpoint(ckpt, f"step{SAVE_AT}")
    res: dict = {"global_step_after_load": b.global_step}
    if forget_rng:
        torch.manual_seed(999)  # a resume that lost the RNG state: other dropout masks
    batches = [rank_batch(b.rank, seed=step) for step in range(TOTAL)]
    res["tail"] = [
        (m["loss"], m["lr"]) for m in (b.train_step(x, nll_loss) for x in batches[SAVE_AT:])
    ]
    if export_dir is not None:
        probe = rank_batch(0, seed=7)
        b.engine.eval()
        with torch.no_grad():
            logits = b.engine(
                input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]
            ).logits
        b.export_hf(export_dir)
        if b.rank == 0:
            from transformers import AutoModelForCausalLM

            plain = AutoModelForCausalLM.from_pretrained(export_dir, dtype="float32").eval()
            with torch.no_grad():
                plain_logits = plain(**probe).logits
            res["export_logits_max_abs_diff"] = (plain_logits - logits).abs().max().item()
    b.close()
    return res


def _checks(model_path: str, work: str) -> dict:
    out = {}
    for kind, lora in (("full", False), ("lora", True)):
        ckpt = os.path.join(work, kind)
        out[kind] = _train_and_save(model_path, ckpt, lora)
        export = os.path.join(work, "export") if kind == "full" else None
        out[f"{kind}_resumed"] = _resume(model_path, ckpt, lora, export_dir=export)
    out["control"] = _resume(model_path, os.path.join(work, "full"), False, forget_rng=True)
    return out


@pytest.fixture
def dropout_model_dir(tiny_qwen2_dir, tmp_path):
    """The tiny model with attention dropout, so resumed training depends on restored RNG."""
    path = tmp_path / "tiny_dropout"
    shutil.copytree(tiny_qwen2_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.2
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_resume_is_exact_and_export_loads(dropout_model_dir, tmp_path):
    results = run_distributed(
        _checks, world_size=2, args=(dropout_model_dir, str(tmp_path)), timeout_s=500
    )
    for rank, res in enumerate(results):
        for kind in ("full", "lora"):
            resumed = res[f"{kind}_resumed"]
            assert resumed["global_step_after_load"] == SAVE_AT
            assert resumed["tail"] == res[kind]["tail"], f"rank {rank} {kind}: resumed run diverged"
        # Same checkpoint, RNG deliberately not restored: losses differ, so the test can fail.
        assert res["control"]["tail"][0][0] != res["full"]["tail"][0][0], res
    assert results[0]["full_resumed"]["export_logits_max_abs_diff"] <= 1e-5, results[0]
