"""Which inputs each advantage estimator reads, known without importing torch.

One table shared by the estimator registry (``roll_ds.algorithms.advantages`` registers each
estimator with its row) and config validation (which warns about settings an estimator ignores
and must stay importable without torch).

    values_BT   critic values: the estimator needs a ``critic`` role
    gamma, lam  the ``algorithm`` fields of the same name

``algorithm.whiten_advantages`` applies to every estimator (masked whitening of the final
advantages); the ones in ``ALWAYS_WHITENED`` already return whitened advantages.
"""

from __future__ import annotations

ESTIMATOR_OPTIONS: dict[str, frozenset[str]] = {
    "grpo": frozenset(),
    "dr_grpo": frozenset(),
    "rloo": frozenset(),
    "reinforce_plus_plus": frozenset({"gamma"}),
    "reinforce_plus_plus_baseline": frozenset({"gamma"}),
    "gae": frozenset({"values_BT", "gamma", "lam"}),
}
ALWAYS_WHITENED = frozenset({"reinforce_plus_plus", "reinforce_plus_plus_baseline"})


def estimators_using(option: str) -> list[str]:
    """Names of the estimators that read ``option``, sorted."""
    return sorted(name for name, options in ESTIMATOR_OPTIONS.items() if option in options)


def needs_critic(estimator: str) -> bool:
    """Whether ``estimator`` reads critic values (the pipeline then builds a critic role)."""
    return "values_BT" in ESTIMATOR_OPTIONS.get(estimator, frozenset())
