"""ppo_epochs: how many passes the train step makes, in which row order, and their metrics."""

import pytest

from roll_ds.pipeline.passes import merge_pass_metrics, pass_orders


def test_one_epoch_is_one_pass_in_rollout_order():
    assert pass_orders(5, 1, seed=7) == [[0, 1, 2, 3, 4]]


def test_later_passes_are_seeded_permutations():
    orders = pass_orders(16, 3, seed=7)
    assert len(orders) == 3
    assert orders[0] == list(range(16))
    for order in orders[1:]:
        assert sorted(order) == list(range(16))
    assert orders[1] != orders[0] and orders[2] != orders[1]
    assert pass_orders(16, 3, seed=7) == orders  # a resumed run repeats them
    assert pass_orders(16, 3, seed=8)[1] != orders[1]


def test_ppo_epochs_must_be_positive():
    with pytest.raises(ValueError, match=r"algorithm\.ppo_epochs must be >= 1, got 0"):
        pass_orders(4, 0, seed=0)


def test_merge_pass_metrics_sums_steps_averages_the_rest():
    merged = merge_pass_metrics(
        [
            {"optimizer_steps": 2.0, "lr": 1e-3, "grad_norm": 1.0, "actor/pg_loss": 0.5},
            {"optimizer_steps": 2.0, "lr": 2e-3, "grad_norm": 3.0, "actor/pg_loss": -0.1},
        ]
    )
    assert merged == pytest.approx(
        {"optimizer_steps": 4.0, "lr": 2e-3, "grad_norm": 2.0, "actor/pg_loss": 0.2}
    )
    assert merge_pass_metrics([{"loss": 1.5}]) == {"loss": 1.5}


def test_merge_pass_metrics_keeps_the_last_loss_scale_and_skip_count():
    # fp16: the scale after the last pass and the run's cumulative count of skipped steps
    merged = merge_pass_metrics(
        [
            {"train/loss_scale": 65536.0, "train/overflow_steps": 1.0, "perf/tflops": 1.0},
            {"train/loss_scale": 32768.0, "train/overflow_steps": 2.0, "perf/tflops": 3.0},
        ]
    )
    assert merged == {"train/loss_scale": 32768.0, "train/overflow_steps": 2.0, "perf/tflops": 2.0}


class FakeCluster:
    """The Ray boundary: records each train_step's row order and answers like two ranks."""

    def __init__(self) -> None:
        self.orders: list[list[int]] = []
        self.loss_fns: list[object] = []

    def submit(self, method: str, batch, loss_fn):
        assert method == "train_step"
        self.orders.append(batch["input_ids"][:, 0].tolist())
        self.loss_fns.append(loss_fn)
        per_rank = [
            {"optimizer_steps": 1.0, "lr": 0.1, "grad_norm": 1.0, "loss": 2.0, "perf/mfu": 0.1},
            {"optimizer_steps": 1.0, "lr": 0.1, "grad_norm": 3.0, "loss": 4.0, "perf/mfu": 0.3},
        ]
        return type("Pending", (), {"get": lambda self: per_rank})()


def test_pipeline_train_makes_ppo_epochs_passes_for_actor_and_critic(monkeypatch):
    import torch

    from roll_ds.config import load_config
    from roll_ds.config.compose import PROJECT_ROOT
    from roll_ds.distributed.batch import Batch
    from roll_ds.pipeline.rlvr import RLVRPipeline
    from roll_ds.pipeline.seeds import step_seed

    monkeypatch.chdir(PROJECT_ROOT)
    cfg = load_config("rlvr_ppo_gae_zero3", ["algorithm.ppo_epochs=3"])
    pipeline = RLVRPipeline(cfg)
    from roll_ds.pipeline.model_roles import role_handles

    pipeline.clusters = {"actor_train": FakeCluster(), "critic": FakeCluster()}
    pipeline.roles = role_handles(pipeline.clusters)
    rows = 8
    columns = ("attention_mask", "response_mask", "old_logprobs", "advantages", "values")
    batch = Batch(
        {
            "input_ids": torch.arange(rows)[:, None].repeat(1, 3),
            **{k: torch.zeros(rows, 3) for k in (*columns, "returns", "rollout_logprobs")},
        }
    )
    metrics = pipeline.train(batch, step=5)

    expected = pass_orders(rows, 3, step_seed(cfg.seed, 5, 0))
    assert expected[0] == list(range(rows)) and expected[1] != expected[0]
    for name, loss_type in (("actor_train", "PolicyLoss"), ("critic", "ValueLoss")):
        fake = pipeline.clusters[name]
        assert fake.orders == expected, name  # 3 passes; actor and critic see the same order
        assert {type(f).__name__ for f in fake.loss_fns} == {loss_type}
    assert metrics["optimizer_steps"] == 3.0 and metrics["critic/optimizer_steps"] == 3.0
    assert metrics["grad_norm"] == 2.0 and metrics["critic/grad_norm"] == 2.0
    assert metrics["loss"] == 3.0 and metrics["critic/lr"] == 0.1
    # the trainer's own prefixed metrics: the critic's get critic/, the actor's stay
    assert metrics["perf/mfu"] == pytest.approx(0.2)
    assert metrics["critic/perf/mfu"] == pytest.approx(0.2)


def test_lr_schedule_spans_every_optimizer_step_of_the_run():
    from roll_ds.config import load_config
    from roll_ds.pipeline.passes import schedule_steps

    # 16 prompts x 8 samples = 128 rows; a train batch is 16 x 2 (accumulation) x 2 ranks = 64
    # rows: 2 optimizer steps per pass, 40 steps.
    cfg = load_config("rlvr_ppo_gae_zero3", check_files=False)
    assert schedule_steps(cfg, "actor_train") == 40 * 2
    cfg = load_config(
        "rlvr_ppo_gae_zero3",
        ["algorithm.ppo_epochs=3", "critic.training_args.per_device_train_batch_size=8"],
        check_files=False,
    )
    assert schedule_steps(cfg, "actor_train") == 40 * 3 * 2
    assert schedule_steps(cfg, "critic") == 40 * 3 * 4
