"""One evaluation of the policy the rollout engines serve, on the held-out tasks.

The held-out dataset rows and the ``val_env_manager`` episodes play through the rollout phase's
runner like training episodes, with ``validation.generating_args`` (greedy by default). Shared by
the training loop (after syncing the trainer's weights) and ``python -m roll_ds.evaluate`` (an
exported model or a converted checkpoint), so both report the same numbers for the same weights.
What is reported: ``eval_metrics.py`` (rows) and ``roll_ds.agentic.runner.episode_metrics``
(environments).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roll_ds.agentic.runner import episode_metrics
from roll_ds.pipeline.eval_metrics import (
    PREFIX,
    SAMPLED,
    length_metrics,
    pass_ks,
    sampled_metrics,
)
from roll_ds.pipeline.rollout import domain_metrics
from roll_ds.pipeline.scoring import score_rows

if TYPE_CHECKING:
    from roll_ds.agentic.episode import Episode
    from roll_ds.pipeline.rollout_phase import RolloutPhase


def evaluate_policy(phase: RolloutPhase) -> dict[str, float]:
    """Rows: greedy accuracy per domain (``eval/accuracy``, ``eval/<domain>/accuracy``, ...) and
    the responses' lengths; with ``validation.num_samples`` also mean@k / pass@k and the samples'
    lengths. Environments: ``eval/success`` (and per tag, turns, tool calls, ...)."""
    cfg, tasks = phase.cfg, phase.tasks
    val = cfg.validation
    gen = val.generating_args
    sampling = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
    max_new = gen.max_new_tokens or cfg.response_length
    specs = tasks.eval_row_specs(1) + tasks.eval_env_specs(ahead=phase.queue is not None)
    episodes, _ = phase.runner(sampling, max_new_tokens=max_new).run(specs, seed=cfg.seed)
    rows = [e for e in episodes if e.is_row]
    metrics: dict[str, float] = {}
    if rows:
        metrics.update(_row_metrics(phase, rows))
    envs = [e for e in episodes if not e.is_row]
    if envs:
        metrics.update(episode_metrics(envs, PREFIX))
    if rows and val.num_samples:
        sampled, _ = phase.runner(
            {**sampling, "temperature": val.sample_temperature}, max_new_tokens=max_new
        ).run(tasks.eval_row_specs(val.num_samples), seed=cfg.seed)
        _score(phase, sampled)
        correct = [e.info.get("correct") for e in sampled]
        metrics.update(
            sampled_metrics(
                [e.row for e in sampled], [e.tag for e in sampled], correct, pass_ks(val)
            )
        )
        metrics.update(
            length_metrics(
                [len(e.token_ids) for e in sampled],
                [e.finish_reason for e in sampled],
                f"{PREFIX}/{SAMPLED}",
            )
        )
    return metrics


def _row_metrics(phase: RolloutPhase, rows: list[Episode]) -> dict[str, float]:
    _score(phase, rows)
    metrics = domain_metrics(
        PREFIX, [e.tag for e in rows], [e.total_reward for e in rows], [e.info for e in rows]
    )
    metrics.update(
        length_metrics([len(e.token_ids) for e in rows], [e.finish_reason for e in rows])
    )
    return metrics


def _score(phase: RolloutPhase, episodes: list[Episode]) -> None:
    tasks = phase.tasks
    score_rows(episodes, tasks.eval_rows, phase.clusters, tasks.routes, phase.tokenizer)
