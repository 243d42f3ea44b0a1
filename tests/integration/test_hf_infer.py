"""hf_infer on its own (batching, left padding, entropy, generate, load_weights), and log-prob
agreement of hf_infer, deepspeed_train and deepspeed_infer (ZeRO-3, 2 CPU ranks, uneven
per-rank batches) on the same weights."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from _train_helpers import make_strategy, nll_loss, preset, quiet, rank_batch

pytestmark = pytest.mark.integration

ATOL = 1e-5  # fp32, same weights; kernels and batch shapes differ


def _hf(model_path: str, **kw):
    from strategies.hf_infer import HfInferStrategy

    quiet()
    s = HfInferStrategy(model_path=model_path, **kw)
    s.initialize()
    return s


def test_hf_infer_logprobs_generate_and_load(tiny_qwen2_dir):
    from roll_ds.config.schema import GeneratingArgs
    from roll_ds.models.tensors import position_ids_from_mask
    from strategies._common import entropy_from_logits

    s = _hf(
        tiny_qwen2_dir,
        infer_batch_size=3,
        generating_args=GeneratingArgs(max_new_tokens=6, num_return_sequences=3, seed=5),
    )
    batch = rank_batch(0, rows=5)
    out = s.compute_logprobs(batch["input_ids"], batch["attention_mask"], with_entropy=True)
    assert out["logprobs_BT"].shape == (5, 11) and out["entropy_BT"].shape == (5, 11)
    s.infer_batch_size = 1
    single = s.compute_logprobs(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(single["logprobs_BT"], out["logprobs_BT"], atol=ATOL, rtol=0)

    # Row 0 is left-padded by 3: its real tokens score as the unpadded sequence alone.
    alone = s.compute_logprobs(batch["input_ids"][:1, 3:], batch["attention_mask"][:1, 3:])
    torch.testing.assert_close(
        out["logprobs_BT"][0, 3:], alone["logprobs_BT"][0], atol=ATOL, rtol=0
    )

    with torch.no_grad():
        logits = s.model(
            **batch, position_ids=position_ids_from_mask(batch["attention_mask"])
        ).logits
    torch.testing.assert_close(
        out["entropy_BT"], entropy_from_logits(logits[:, :-1]), atol=ATOL, rtol=0
    )

    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    gen = s.generate(prompts)
    again = s.generate(prompts)
    assert gen == again  # seeded: reproducible
    assert gen["prompt_index"] == [0, 0, 0, 1, 1, 1] and gen["sample_index"] == [0, 1, 2] * 2
    assert set(gen["finish_reason"]) <= {"stop", "length"}
    assert all(1 <= len(r) <= 6 for r in gen["response_ids"])
    assert len({tuple(r) for r in gen["response_ids"][:3]}) > 1  # sampling, not 3 copies
    for i, (resp, lps) in enumerate(zip(gen["response_ids"], gen["logprobs"], strict=True)):
        seq = torch.tensor([prompts[gen["prompt_index"][i]] + resp])
        scored = s.compute_logprobs(seq, torch.ones_like(seq))["logprobs_BT"][0, -len(resp) :]
        torch.testing.assert_close(torch.tensor(lps), scored, atol=1e-4, rtol=0)

    # Log-probs at the rollout temperature (the context's default, or per call), for scoring
    # and for generate's sampled tokens alike.
    tempered = _hf(tiny_qwen2_dir, logprob_temperature=0.7)
    expected = torch.log_softmax(logits[:, :-1].float() / 0.7, -1)
    expected = expected.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    got = tempered.compute_logprobs(batch["input_ids"], batch["attention_mask"])["logprobs_BT"]
    mask = batch["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(got[mask], expected[mask], atol=ATOL, rtol=0)
    at_one = tempered.compute_logprobs(batch["input_ids"], batch["attention_mask"], temperature=1)
    torch.testing.assert_close(at_one["logprobs_BT"], out["logprobs_BT"], atol=ATOL, rtol=0)
    hot = s.generate(prompts, temperature=0.7)
    for i, (resp, lps) in enumerate(zip(hot["response_ids"], hot["logprobs"], strict=True)):
        seq = torch.tensor([prompts[hot["prompt_index"][i]] + resp])
        scored = tempered.compute_logprobs(seq, torch.ones_like(seq))["logprobs_BT"]
        torch.testing.assert_close(torch.tensor(lps), scored[0, -len(resp) :], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="logprob_temperature must be > 0"):
        _hf(tiny_qwen2_dir, logprob_temperature=0.0)

    # load_weights: HF names incl. the tied head; a zeroed model scores uniform log-probs.
    names = [n for n, _ in s.model.named_parameters(remove_duplicate=False)]
    s.load_weights((n, torch.zeros_like(p)) for n, p in s.model.named_parameters())
    uniform = s.compute_logprobs(batch["input_ids"], batch["attention_mask"])["logprobs_BT"]
    torch.testing.assert_close(
        uniform, torch.full_like(uniform, -torch.log(torch.tensor(128.0)).item())
    )
    assert "lm_head.weight" in names or s.model.config.tie_word_embeddings
    with pytest.raises(KeyError):
        s.load_weights([("not.a.param", torch.zeros(1))])


def test_strategies_build_from_worker_config(tiny_qwen2_dir):
    from roll_ds.config.schema import ModelArgs, StrategyArgs, TrainingArgs, WorkerConfig
    from roll_ds.strategy import STRATEGIES, StrategyContext

    ctx = StrategyContext(
        pretrain=tiny_qwen2_dir,
        seed=7,
        max_steps=30,
        response_length=9,
        stop_token_ids=(3,),
        logprob_temperature=0.7,
    )
    worker = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="deepspeed_train", strategy_config=preset(3)),
        model_args=ModelArgs(lora_rank=8),
        training_args=TrainingArgs(warmup_steps=2),
        infer_batch_size=5,
    )
    train = STRATEGIES.get("deepspeed_train").from_worker_config(worker, ctx)
    assert (train.model_path, train.seed, train.max_steps, train.infer_batch_size) == (
        tiny_qwen2_dir,
        7,
        30,
        5,
    )
    assert train.is_lora and train.strategy_config["zero_optimization"]["stage"] == 3
    infer = STRATEGIES.get("deepspeed_infer").from_worker_config(worker, ctx)
    assert infer.infer_batch_size == 5
    hf = STRATEGIES.get("hf_infer").from_worker_config(worker, ctx)
    assert (hf.max_new_tokens, hf.stop_token_ids) == (9, [3])
    assert train.logprob_temperature == infer.logprob_temperature == hf.logprob_temperature == 0.7


def _agreement(model_path: str) -> dict:
    from strategies.deepspeed.infer import DeepSpeedInferStrategy

    res: dict = {}
    hf = _hf(model_path, infer_batch_size=4)
    probe = rank_batch(0, rows=5, seed=3)
    rows = {0: 5, 1: 2}  # uneven per-rank batches: ZeRO-3 forwards must stay paired
    train = make_strategy(
        model_path, 3, zero={"stage3_param_persistence_threshold": 0}, infer_batch_size=2
    )
    n = rows[train.rank]
    ids, mask = probe["input_ids"][:n], probe["attention_mask"][:n]
    expected = hf.compute_logprobs(ids, mask, with_entropy=True)
    got = train.compute_logprobs(ids, mask, with_entropy=True)
    res["train_vs_hf"] = (got["logprobs_BT"] - expected["logprobs_BT"]).abs().max().item()
    res["train_entropy_vs_hf"] = (got["entropy_BT"] - expected["entropy_BT"]).abs().max().item()
    hot = train.compute_logprobs(ids, mask, temperature=0.7)["logprobs_BT"]
    res["train_vs_hf_at_0.7"] = (
        (hot - hf.compute_logprobs(ids, mask, temperature=0.7)["logprobs_BT"]).abs().max().item()
    )

    # After training, the synced weights loaded into hf_infer score like the engine.
    train.train_step(rank_batch(train.rank), nll_loss)
    after = train.compute_logprobs(ids, mask)["logprobs_BT"]
    hf.load_weights(t for bucket in train.named_weights_for_sync(1 << 20) for t in bucket)
    res["trained_vs_hf_synced"] = (
        (after - hf.compute_logprobs(ids, mask)["logprobs_BT"]).abs().max().item()
    )
    res["trained_moved"] = (after - expected["logprobs_BT"]).abs().max().item()
    train.close()

    infer = DeepSpeedInferStrategy(
        model_path=model_path,
        strategy_config=preset(3, stage3_param_persistence_threshold=0),
        infer_batch_size=2,
    )
    infer.initialize()
    res["infer_partitioned"] = all(p.numel() == 0 for p in infer.engine.module.parameters())
    n = {0: 5, 1: 0}[infer.rank]  # a rank with nothing to score still joins the gathers
    ref = (
        _hf(model_path).compute_logprobs(probe["input_ids"][:n], probe["attention_mask"][:n])
        if n
        else None
    )
    got = infer.compute_logprobs(probe["input_ids"][:n], probe["attention_mask"][:n])
    res["infer_rows"] = got["logprobs_BT"].shape[0]
    res["infer_vs_hf"] = (got["logprobs_BT"] - ref["logprobs_BT"]).abs().max().item() if n else 0.0
    infer.close()
    return res


def test_logprobs_agree_across_strategies(tiny_qwen2_dir):
    results = run_distributed(_agreement, world_size=2, args=(tiny_qwen2_dir,), timeout_s=300)
    for rank, res in enumerate(results):
        assert res["train_vs_hf"] <= ATOL and res["train_entropy_vs_hf"] <= ATOL, (rank, res)
        assert res["train_vs_hf_at_0.7"] <= ATOL, (rank, res)
        assert res["trained_vs_hf_synced"] <= ATOL and res["trained_moved"] > 1e-3, (rank, res)
        assert res["infer_partitioned"], res
        assert res["infer_rows"] == (5, 0)[rank]
        assert res["infer_vs_hf"] <= ATOL, (rank, res)
