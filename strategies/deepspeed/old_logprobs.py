"""Old log-probs filled in by the train step (``train_step_with_old_logprobs``).

The separate log-prob pass scores every row under the policy as it is before the step's first
update. A train step gets most of those numbers for free: the rows of its first optimizer step
are trained before any update, so their train forward's log-probs (detached) are the old
policy's. Only the rows of the later optimizer steps need a no-grad forward, run before
training starts. A train forward with dropout is not the old policy's; every row then gets the
no-grad forward.

Works for row-count and token-budget micro batches alike: each micro batch knows its rows of the
batch, and a token-budget micro batch's log-probs, cut to its own width, are written back into
the batch's ``[B, T-1]`` (columns past the cut are padding and stay 0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

ComputeLogprobs = Callable[[torch.Tensor, torch.Tensor], Mapping[str, torch.Tensor]]


@dataclass
class OldLogprobs:
    """The batch's ``old_logprobs_BT`` ``[B, T-1]`` as training fills them in: rows past
    ``own_rows`` come from the no-grad forward before training; the first ``own_rows`` (the
    first optimizer step's, or none) from ``put`` as their micro batches train."""

    old_BT: torch.Tensor
    own_rows: int

    @classmethod
    def before_training(
        cls,
        compute: ComputeLogprobs,
        batch: Mapping[str, torch.Tensor],
        *,
        own_rows: int,
    ) -> OldLogprobs:
        """Run the no-grad forward (``compute``: the strategy's ``compute_logprobs``) over the
        rows after the first ``own_rows``; those rows stay zero until ``put``. Every rank holds
        as many rows, so under ZeRO-3 every rank joins as many forwards."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        old = torch.zeros(ids.shape[0], max(0, ids.shape[1] - 1), dtype=torch.float32)
        if ids.shape[0] > own_rows:
            old[own_rows:] = compute(ids[own_rows:], mask[own_rows:])["logprobs_BT"].float()
        return cls(old_BT=old, own_rows=own_rows)

    def from_forward(self, rows: Sequence[int]) -> bool:
        """Whether a micro batch of ``rows`` takes its train forward's own log-probs."""
        return self.own_rows > 0 and max(rows) < self.own_rows

    def put(self, rows: Sequence[int], logprobs_BW: torch.Tensor) -> None:
        """A micro batch's train-forward log-probs (``[len(rows), W]``, ``W <= T-1``)."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        self.old_BT[index, : logprobs_BW.shape[1]] = logprobs_BW.detach().float().cpu()
