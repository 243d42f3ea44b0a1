"""Draw prompt batches across domains, deterministically and resumably.

Each step picks the domain of every prompt with probabilities ``domain_interleave_probs`` (or in
proportion to the data), then takes the next rows of each domain's shuffled order. Orders are
reshuffled per epoch from ``(seed, domain, epoch)`` and the domain draw comes from ``(seed, step)``,
so the whole sampler state is a few integers: a resumed run draws exactly the prompts an
uninterrupted run would have, none skipped or repeated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class PromptSampler:
    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        seed: int,
        domain_probs: Mapping[str, float] | None = None,
        domain_key: str = "domain",
    ) -> None:
        if not rows:
            raise ValueError("PromptSampler: no rows to sample from")
        by_domain: dict[str, list[Mapping[str, Any]]] = {}
        for row in rows:
            by_domain.setdefault(str(row[domain_key]), []).append(row)
        self.domains = sorted(by_domain)
        self._rows = by_domain
        self.seed = seed
        self.probs = self._normalise(domain_probs)
        self.step = 0
        self.cursor = dict.fromkeys(self.domains, 0)  # rows consumed per domain, over all epochs
        self._orders: dict[tuple[str, int], np.ndarray] = {}

    def _normalise(self, domain_probs: Mapping[str, float] | None) -> np.ndarray:
        if not domain_probs:
            sizes = np.array([len(self._rows[d]) for d in self.domains], dtype=np.float64)
            return sizes / sizes.sum()
        unknown = sorted(set(domain_probs) - set(self.domains))
        if unknown:
            raise ValueError(
                f"data_args.domain_interleave_probs: domains {unknown} have no rows; "
                f"the data has {self.domains}"
            )
        weights = np.array([float(domain_probs.get(d, 0.0)) for d in self.domains])
        if (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(
                "data_args.domain_interleave_probs: weights must be >= 0 with a positive sum"
            )
        return weights / weights.sum()

    def next_batch(self, n: int) -> list[Mapping[str, Any]]:
        rng = np.random.default_rng([self.seed, self.step])
        picks = rng.choice(len(self.domains), size=n, p=self.probs)
        self.step += 1
        return [self._take(self.domains[i]) for i in picks]

    def _take(self, domain: str) -> Mapping[str, Any]:
        rows = self._rows[domain]
        epoch, offset = divmod(self.cursor[domain], len(rows))
        self.cursor[domain] += 1
        return rows[int(self._order(domain, epoch)[offset])]

    def _order(self, domain: str, epoch: int) -> np.ndarray:
        key = (domain, epoch)
        if key not in self._orders:
            rng = np.random.default_rng([self.seed, self.domains.index(domain), epoch])
            self._orders = {k: v for k, v in self._orders.items() if k[0] != domain}
            self._orders[key] = rng.permutation(len(self._rows[domain]))
        return self._orders[key]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": dict(self.cursor)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state["cursor"]) != set(self.domains):
            raise ValueError(
                f"checkpoint's data domains {sorted(state['cursor'])} differ from the "
                f"configured data's {self.domains}; resume with the same data files"
            )
        self.step = int(state["step"])
        self.cursor = {d: int(c) for d, c in state["cursor"].items()}
