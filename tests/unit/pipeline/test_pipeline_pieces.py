import pytest
import torch

from roll_ds.config.schema import AlgorithmConfig
from roll_ds.distributed.batch import Batch
from roll_ds.pipeline.loss_fns import PolicyLoss
from roll_ds.pipeline.model_roles import TrainingRole
from roll_ds.pipeline.sequences import pack_sequences, scatter_response_values


def test_pack_sequences_aligns_response_mask_with_shifted_logprobs():
    out = pack_sequences([[5, 6], [7]], [[8, 9, 2], [3]], pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 8, 9, 2], [7, 3, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # column j scores token j+1: row 0 response tokens are at 2,3,4 -> columns 1,2,3
    assert out["response_mask"].tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]


def test_scatter_response_values_places_values_under_the_mask():
    values = scatter_response_values([[-0.1, -0.2, -0.3], [-0.5]], [2, 1], width=5)
    assert torch.allclose(
        values, torch.tensor([[0, -0.1, -0.2, -0.3], [-0.5, 0, 0, 0]], dtype=torch.float32)
    )


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    # On-policy (logprobs == old) the PPO ratio is 1: token-mean loss = -mean(A) over valid tokens.
    loss_fn = PolicyLoss.from_config(AlgorithmConfig(), response_length=4)
    mask = torch.tensor([[0.0, 1, 1, 0], [1, 1, 1, 1]])
    adv = torch.tensor([[0.0, 1, 1, 0], [-0.5, -0.5, -0.5, -0.5]])
    logp = torch.log(torch.full((2, 4), 0.5))
    batch = {"response_mask": mask, "old_logprobs": logp.clone(), "advantages": adv}
    loss, metrics = loss_fn(logp, batch)
    expected = -(1 + 1 - 0.5 * 4) / 6
    assert abs(loss.item() - expected) < 1e-6
    assert metrics["actor/clipfrac"] == 0.0
    assert abs(metrics["actor/ratio_mean"] - 1.0) < 1e-6


def test_policy_loss_adds_kl_and_entropy_terms():
    algo = AlgorithmConfig(kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    loss_fn = PolicyLoss.from_config(algo, response_length=2)
    mask = torch.ones(1, 2)
    logp = torch.tensor([[-1.0, -2.0]])
    batch = {
        "response_mask": mask,
        "old_logprobs": logp.clone(),
        "advantages": torch.zeros(1, 2),
        "ref_logprobs": torch.tensor([[-1.5, -2.5]]),
    }
    entropy = torch.tensor([[0.7, 0.3]])
    loss, metrics = loss_fn(logp, batch, entropy)
    # pg 0; k1 = logp - ref = 0.5 per token -> 0.5 * 0.5; entropy mean 0.5 -> -0.1 * 0.5
    assert abs(loss.item() - (0.25 - 0.05)) < 1e-6
    assert abs(metrics["actor/kl_loss"] - 0.5) < 1e-6
    assert abs(metrics["actor/entropy"] - 0.5) < 1e-6


def test_domain_routes_require_every_domain_once():
    from roll_ds.pipeline.rollout import domain_routes

    assert domain_routes(["math", "reverse"], {"m": ["math"], "r": ["reverse"]}) == {
        "math": "m",
        "reverse": "r",
    }
    import pytest

    with pytest.raises(ValueError, match=r"no reward role scores the data domains \['reverse'\]"):
        domain_routes(["math", "reverse"], {"m": ["math"]})
    with pytest.raises(ValueError, match="domain 'math' is also in m"):
        domain_routes(["math"], {"m": ["math"], "m2": ["math"]})


def test_group_has_signal():
    from roll_ds.pipeline.scoring import group_has_signal

    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert group_has_signal(scores, 2).tolist() == [False, False, True]


def test_domain_metrics_by_hand():
    from roll_ds.pipeline.rollout import domain_metrics

    infos = [{"correct": True}, {"correct": False}, {"correct": True, "timed_out": True}, {}]
    out = domain_metrics("eval", ["a", "a", "b", "b"], [1.0, 0.0, 1.0, 0.5], infos)
    assert out["eval/score"] == 0.625
    assert out["eval/accuracy"] == 2 / 3  # rows without "correct" do not count
    assert out["eval/a/accuracy"] == 0.5
    assert out["eval/b/accuracy"] == 1.0
    assert out["eval/b/score"] == 0.75
    assert out["eval/timeouts"] == 1.0
    assert not any(k.startswith("eval/failures") or "judge" in k for k in out)  # none reported


def test_domain_metrics_count_failure_categories_and_unparsed_verdicts():
    from roll_ds.pipeline.rollout import domain_metrics

    infos = [
        {"correct": True, "error_category": "passed"},
        {"correct": False, "error_category": "timeout"},
        {"correct": False, "error_category": "timeout"},
        {"correct": False, "error_category": "output_limit"},
        {"correct": False, "judge_unparsed": True},
        {"correct": True, "judge_unparsed": False},
    ]
    out = domain_metrics("rollout", ["code"] * 4 + ["qa"] * 2, [1, 0, 0, 0, 0, 1], infos)
    assert out["rollout/failures/timeout"] == 2.0
    assert out["rollout/failures/output_limit"] == 1.0
    assert "rollout/failures/passed" not in out
    assert out["rollout/judge_unparsed"] == 1.0


# --- issue 10: dynamic sampling padding, mask_truncated, overlong penalty ---------------------


def _groups(ids: list[str], group: int = 2) -> list[list[str]]:
    return [[f"{g}.{j}" for j in range(group)] for g in ids]


def test_dynamic_batch_pads_with_spare_groups_never_a_kept_one_twice():
    from roll_ds.pipeline.scoring import fit_groups

    kept = _groups(["a", "b"])
    spare = _groups(["x", "y", "z"])
    flat, padding = fit_groups(kept, spare, want=4)
    assert flat == ["a.0", "a.1", "b.0", "b.1", "x.0", "x.1", "y.0", "y.1"]
    assert padding == 2  # groups
    # Enough kept groups: trimmed, no padding.
    flat, padding = fit_groups(_groups(["a", "b", "c"]), spare, want=2)
    assert flat == ["a.0", "a.1", "b.0", "b.1"] and padding == 0
    # Nothing kept at all: every group is padding.
    flat, padding = fit_groups([], spare, want=3)
    assert padding == 3 and len(flat) == 6


class _Tok:
    pad_token_id = 0
    eos_token_id = 2


def _cfg(**algo):
    from roll_ds.config.schema import RLVRConfig

    return RLVRConfig(response_length=4, algorithm=AlgorithmConfig(**algo))


def _rows(finish: list[str], responses: list[list[int]]):
    """Scored row episodes (reward 1 each), prompt [5, 6]."""
    from roll_ds.agentic.episode import DONE, Episode

    episodes = []
    for i, (reason, ids) in enumerate(zip(finish, responses, strict=True)):
        e = Episode(-1 - i, i, "math", -1, row=i)
        e.prompt_ids = [5, 6]
        e.add_policy_turn(ids, [-0.5] * len(ids), closed=True, finish_reason=reason)
        e.turn_rewards[-1] = 1.0
        e.end(DONE)
        episodes.append(e)
    return episodes


def _pack(episodes, mask_truncated):
    from roll_ds.pipeline.packing import pack_episodes

    rows = [{"id": str(i)} for i in range(len(episodes))]
    return pack_episodes(episodes, rows, pad_id=0, mask_truncated=mask_truncated)


def test_mask_truncated_masks_the_loss_only():
    packed = _pack(_rows(["stop", "length"], [[7, 2], [7, 8, 9, 9]]), mask_truncated=True)
    assert packed["response_mask"].sum(-1).tolist() == [2.0, 4.0]  # advantages, critic, KL
    assert packed["loss_mask"].sum(-1).tolist() == [2.0, 0.0]  # the policy loss
    off = _pack(_rows(["stop", "length"], [[7, 2], [7, 8, 9, 9]]), mask_truncated=False)
    assert torch.equal(off["loss_mask"], off["response_mask"])
    assert list(off["id"]) == ["0", "1"] and "turns" not in off.non_tensors  # rows only


def test_overlong_penalty_is_added_to_training_scores():
    from roll_ds.pipeline.scoring import apply_overlong_penalty

    episodes = _rows(["stop", "stop", "length"], [[2], [7, 8, 2], [7, 8, 9, 9]])
    cfg = _cfg(overlong_buffer_len=2, overlong_penalty_factor=0.5)
    penalty = apply_overlong_penalty(episodes, torch.ones(3), cfg.algorithm, cfg.response_length)
    # response_length 4, buffer 2: free up to 2 tokens, then -0.5 * (len - 2) / 2.
    assert penalty.tolist() == [0.0, -0.25, -0.5]
    assert [e.total_reward for e in episodes] == [1.0, 0.75, 0.5]
    off = _cfg()
    assert apply_overlong_penalty(episodes, torch.ones(3), off.algorithm, 4) is None


def test_filter_overlong_prompts_drops_and_counts(caplog):
    from roll_ds.config.schema import DataArgs
    from roll_ds.pipeline.prompt_rows import encode_prompts

    class _Encoding(_Tok):
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text)))}

        def encode(self, text, add_special_tokens=False):
            return list(range(len(text)))

    tok = _Encoding()
    rows = [{"id": "short", "prompt": "ab"}, {"id": "long", "prompt": "abcdef"}]
    with pytest.raises(ValueError, match=r"actor_train.data_args: 1 prompt.*filter_overlong"):
        encode_prompts(tok, [dict(r) for r in rows], DataArgs(), "actor_train", 3)
    data_args = DataArgs(filter_overlong_prompts=True)
    kept = encode_prompts(tok, [dict(r) for r in rows], data_args, "x", 3)
    assert [r["id"] for r in kept] == ["short"]
    assert "dropped 1 of 2 prompts" in caplog.text


def test_old_logprobs_reuse_follows_the_mode_and_the_evidence():
    from roll_ds.pipeline.logprobs import OldLogprobs

    def reuse(cfg, staleness, last_parity):
        old = OldLogprobs.from_config(cfg)
        return old.reuse(staleness=staleness, last_parity=last_parity)

    cfg = _cfg(old_logprobs="auto")
    cfg.actor_train.strategy_args.strategy_name = "deepspeed_train"
    assert reuse(cfg, 0.0, 3e-6)  # on-policy, fp32, parity proven
    assert not reuse(cfg, 1.0, 3e-6)  # off-policy: recompute pi_t
    assert not reuse(cfg, 0.0, 2e-3)  # the engines disagree
    assert not reuse(cfg, 0.0, None)  # no parity probe ran
    cfg.actor_infer.model_args.dtype = "bf16"
    assert not reuse(cfg, 0.0, 3e-6)  # bf16 numbers differ
    for mode, want in (("rollout", True), ("recompute", False)):
        other = _cfg(old_logprobs=mode)
        other.actor_train.strategy_args.strategy_name = "deepspeed_train"
        assert reuse(other, 2.0 if want else 0.0, None if want else 3e-6) is want


def test_old_logprobs_come_from_the_train_step_only_where_nothing_reads_them_before():
    from roll_ds.pipeline.logprobs import OldLogprobs

    def in_train_step(cfg) -> bool:
        return OldLogprobs.from_config(cfg).in_train_step

    cfg = _cfg()
    cfg.actor_train.strategy_args.strategy_name = "deepspeed_train"
    assert in_train_step(cfg)
    cfg.actor_train.max_tokens_per_micro_batch = 64  # token-budget micro-batches too
    assert in_train_step(cfg)
    for change in (
        lambda c: setattr(c.algorithm, "kl_coef", 0.1),  # the reference KL reads them first
        lambda c: setattr(c.algorithm, "ppo_epochs", 2),  # later passes need them fixed
        lambda c: setattr(c.actor_train.model_args, "lora_dropout", 0.1),
        # a backend whose train step cannot give them (the capability, not a name)
        lambda c: setattr(c.actor_train.strategy_args, "strategy_name", "hf_infer"),
    ):
        other = _cfg()
        other.actor_train.strategy_args.strategy_name = "deepspeed_train"
        change(other)
        assert not in_train_step(other)


class _Pending:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class _Actor:
    """Two ranks; records the calls a pass makes and answers as the workers would."""

    world_size = 2

    def __init__(self):
        self.calls = []

    def submit(self, method, batch, *args, **kwargs):
        self.calls.append(method)
        if method == "compute_logprobs":
            return _Pending(Batch({kwargs["key"]: torch.zeros(len(batch), 3)}))
        if method == "train_step":
            return _Pending([{"loss": 1.0}, {"loss": 3.0}])
        half = len(batch) // 2  # each rank's rows, its metrics under its own meta key
        ranks = [
            Batch(
                {"old_logprobs": batch["input_ids"][r * half : (r + 1) * half, 1:].float()},
                meta={f"train_metrics/{r}": {"loss": 1.0 + 2 * r}},
            )
            for r in range(2)
        ]
        return _Pending(Batch.concat(ranks))


def test_the_train_step_fills_old_logprobs_in_row_order_with_both_ranks_metrics():
    from roll_ds.pipeline.logprobs import fill_logprobs
    from roll_ds.pipeline.passes import train_passes

    ids = torch.arange(16).reshape(4, 4)
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones(4, 4, dtype=torch.long)})
    actor = _Actor()
    roles = {"actor_train": TrainingRole(actor)}
    stats = fill_logprobs(
        batch,
        roles,
        reuse=False,
        use_critic=False,
        kl_coef=0.0,
        in_train_step=True,
    )
    assert "old_logprobs" not in batch and actor.calls == []  # no separate pass
    assert stats == {"actor/old_logprobs_recomputed": 1.0, "actor/old_logprobs_in_train_step": 1.0}
    jobs = {"actor_train": (("input_ids", "attention_mask"), None)}
    metrics = train_passes(roles, batch, jobs, ppo_epochs=1, seed=0, fill_old_logprobs=True)
    assert actor.calls == ["train_step_with_old_logprobs"]
    assert torch.equal(batch["old_logprobs"], ids[:, 1:].float())
    assert metrics["loss"] == 2.0  # the mean over both ranks
    with pytest.raises(ValueError, match="in a single pass"):
        train_passes(roles, batch, jobs, ppo_epochs=2, seed=0, fill_old_logprobs=True)


def test_old_logprobs_of_rows_dealt_to_ranks_by_tokens_come_back_in_row_order():
    """With a token budget the pass deals rows to ranks by tokens (``balance_ranks``); the
    ranks return old log-probs in the order they trained them, the batch keeps its own."""
    from roll_ds.pipeline.passes import balance_ranks, train_passes

    ids = torch.arange(32).reshape(8, 4)
    mask = torch.tensor([[1, 1, 1, 1]] * 3 + [[1, 1, 0, 0]] * 5)
    batch = Batch({"input_ids": ids, "attention_mask": mask})
    dealt = balance_ranks(list(range(8)), mask.sum(-1).tolist(), world_size=2, rows_per_step=2)
    assert dealt != list(range(8))  # the case under test: the ranks see another order
    actor = _Actor()
    jobs = {"actor_train": (("input_ids", "attention_mask"), None)}
    train_passes(
        {"actor_train": TrainingRole(actor)},
        batch,
        jobs,
        ppo_epochs=1,
        seed=0,
        balance={"actor_train": 2},
        fill_old_logprobs=True,
    )
    assert torch.equal(batch["old_logprobs"], ids[:, 1:].float())
