from collections import Counter

import pytest

from roll_ds.data.sampler import PromptSampler


def rows(n_math: int, n_rev: int) -> list[dict]:
    return [{"id": f"m{i}", "domain": "math"} for i in range(n_math)] + [
        {"id": f"r{i}", "domain": "reverse"} for i in range(n_rev)
    ]


def test_resume_draws_exactly_what_an_uninterrupted_run_draws():
    data = rows(7, 5)
    straight = PromptSampler(data, seed=3)
    expected = [[r["id"] for r in straight.next_batch(4)] for _ in range(6)]

    first = PromptSampler(data, seed=3)
    got = [[r["id"] for r in first.next_batch(4)] for _ in range(2)]
    state = first.state_dict()
    resumed = PromptSampler(data, seed=3)
    resumed.load_state_dict(state)
    got += [[r["id"] for r in resumed.next_batch(4)] for _ in range(4)]
    assert got == expected


def test_each_epoch_visits_every_row_once_per_domain():
    data = rows(6, 0)
    sampler = PromptSampler(data, seed=0)
    ids = [r["id"] for r in sampler.next_batch(6)] + [r["id"] for r in sampler.next_batch(6)]
    assert sorted(ids[:6]) == sorted(ids[6:]) == sorted(r["id"] for r in data)
    assert ids[:6] != ids[6:]  # reshuffled per epoch


def test_domain_probabilities_are_followed():
    sampler = PromptSampler(rows(50, 50), seed=1, domain_probs={"math": 0.8, "reverse": 0.2})
    counts = Counter(r["domain"] for _ in range(50) for r in sampler.next_batch(20))
    assert 0.75 < counts["math"] / 1000 < 0.85


def test_unknown_domain_in_probs_is_named():
    with pytest.raises(ValueError, match=r"domains \['code'\] have no rows"):
        PromptSampler(rows(2, 2), seed=0, domain_probs={"code": 1.0})


def test_state_from_other_data_is_rejected():
    sampler = PromptSampler(rows(2, 2), seed=0)
    with pytest.raises(ValueError, match="resume with the same data files"):
        sampler.load_state_dict({"step": 1, "cursor": {"math": 1}})
