"""Rows dealt to data-parallel ranks by tokens (``passes.balance_ranks``): the same rows in each
optimizer step, equal row counts, and token sums closer than the rollout order's."""

import random

from roll_ds.pipeline.passes import balance_ranks


def _rank_steps(order, world_size, rows_per_step):
    per_rank = len(order) // world_size
    return [
        [order[r * per_rank + s : r * per_rank + s + rows_per_step] for r in range(world_size)]
        for s in range(0, per_rank, rows_per_step)
    ]


def _spread(ranks, tokens):
    sums = [sum(tokens[i] for i in rows) for rows in ranks]
    return max(sums) - min(sums)


def test_each_optimizer_step_keeps_its_rows_and_evens_the_tokens():
    rng = random.Random(0)
    tokens = [rng.randint(40, 288) for _ in range(64)]
    tokens[:8] = [288] * 8  # the long rows all land on rank 0 in rollout order
    order = list(range(64))
    balanced = balance_ranks(order, tokens, world_size=4, rows_per_step=4)
    assert sorted(balanced) == order
    before, after = _rank_steps(order, 4, 4), _rank_steps(balanced, 4, 4)
    for step_before, step_after in zip(before, after, strict=True):
        assert sorted(i for r in step_before for i in r) == sorted(i for r in step_after for i in r)
        assert all(len(rows) == 4 for rows in step_after)
        assert _spread(step_after, tokens) <= _spread(step_before, tokens)
        assert _spread(step_after, tokens) <= max(tokens)


def test_hand_example_and_orders_left_alone():
    tokens = [10, 1, 9, 2, 8, 3, 7, 4]  # 2 ranks x 1 step of 4 rows
    balanced = balance_ranks(range(8), tokens, world_size=2, rows_per_step=4)
    assert balanced == [0, 6, 7, 1, 2, 4, 5, 3]  # rank sums 22 and 22
    assert balance_ranks([2, 0, 1], [5, 5, 5], world_size=1, rows_per_step=3) == [2, 0, 1]
    assert balance_ranks(range(6), [1] * 6, world_size=4, rows_per_step=1) == list(range(6))


class _Cluster:
    """The Ray boundary: two ranks; records the row order each train_step gets."""

    world_size = 2

    def __init__(self) -> None:
        self.orders: list[list[int]] = []

    def submit(self, method, batch, loss_fn):
        self.orders.append(batch["input_ids"][:, 0].tolist())
        return type("Pending", (), {"get": lambda self: [{"loss": 1.0}, {"loss": 1.0}]})()


def test_train_passes_deals_a_budgeted_roles_rows_by_tokens():
    import torch

    from roll_ds.distributed.batch import Batch
    from roll_ds.pipeline.model_roles import TrainingRole
    from roll_ds.pipeline.passes import train_passes

    lengths = [8, 8, 8, 8, 1, 1, 1, 1]  # rollout order: the long rows all on rank 0
    mask = torch.tensor([[1] * n + [0] * (8 - n) for n in lengths])
    batch = Batch({"input_ids": torch.arange(8).unsqueeze(1).expand(8, 8), "attention_mask": mask})
    clusters = {"actor_train": _Cluster(), "critic": _Cluster()}
    jobs = {
        "actor_train": (("input_ids", "attention_mask"), None),
        "critic": (("input_ids",), None),
    }
    roles = {name: TrainingRole(cluster) for name, cluster in clusters.items()}
    train_passes(roles, batch, jobs, ppo_epochs=1, seed=0, balance={"actor_train": 4})
    [actor], [critic] = clusters["actor_train"].orders, clusters["critic"].orders
    assert critic == list(range(8))  # no budget: rollout order
    assert sorted(actor) == list(range(8))
    assert sum(lengths[i] for i in actor[:4]) == sum(lengths[i] for i in actor[4:]) == 18
