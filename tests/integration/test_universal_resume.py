"""The whole pipeline (run.py) resumed on another number of trainer ranks: a run trains its
LoRA policy under ZeRO-2 on 2 ranks and saves at step 2; a second run resumes that checkpoint on
1 rank (the driver converts it to a DeepSpeed universal checkpoint: docs/zero.md) and trains
steps 3 and 4 (a slow case goes the other way, 1 rank -> 2). Against the saving run's own
steps 3 and 4, which a resume on the same 2 ranks equals exactly (the slow synchronous case runs
that resume too; under async_generation test_rlvr_async.py shows it):

- exactly equal: the prompts of each step (the data order), the sampled responses and their
  rewards (``rollouts.jsonl``), and under ``async_generation`` the batch that was in flight at the
  checkpoint (step 3 trains on it). Step 3 samples from the weights the checkpoint holds, the
  same fp32 values on either size; step 4 from weights one step apart by at most fp32 reduction
  order, where a sampled token would flip only for a draw within ~1e-7 of a boundary;
- within fp32 reduction-order tolerance: the step's losses, gradient norms and the rest of its
  metrics (the trainer's log-probs against vLLM's among them), and the adapter weights the run
  exports at step 4. (Measured: these were equal too:
  the one rank's two micro-batches sum the same two gradient halves that the two ranks'
  all-reduce sums, and a sum of two is exact in either order.)

Each case is two or three pipeline runs (minutes on the 2-core box); CI keeps the asynchronous
one, which also restores the batch played ahead (its synchronous twin differs only in where step
3's batch comes from).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pipeline_run import is_volatile, metrics, run

pytestmark = pytest.mark.integration

EXP = "rlvr_lora_zero3"  # the experiment _pipeline_run's default config names
SAVED = "step_000002"
COMMON = (
    "actor_train.strategy_args.strategy_config=${deepspeed_zero2}",
    "tracking.dump_rollouts_every=1",  # every step's samples, to compare the data order
    "eval_steps=0",  # the exported adapter is compared instead: one vLLM pass less per run
)
# What a user types to resume a 2-rank run on 1 rank (docs/zero.md): the trainer's one device,
# and twice the accumulation, so that an optimizer step still takes the 16 rows it took on 2
# ranks of 8 (else each step makes two optimizer steps of 8 rows).
ONE_RANK = (
    "actor_train.device_mapping=[0]",
    "actor_train.training_args.gradient_accumulation_steps=2",
)
ASYNC = ("async_generation.max_staleness=1",)
LOSS_REL, LOSS_ABS, WEIGHT_TOL = 1e-5, 1e-6, 1e-5


def _straight_and_resumed(
    tmp_path: Path, *extra: str, saving: tuple[str, ...] = (), resuming: tuple[str, ...] = ONE_RANK
) -> tuple[Path, Path]:
    """The saving run (4 steps, a checkpoint at 2; its trainer overrides ``saving``, by default
    the config's 2 ranks) and the run resumed from step 2 with ``resuming`` (1 rank)."""
    straight, resumed = tmp_path / "saving", tmp_path / "resumed"
    saved_ranks, ranks = (1 if saving else 2), (1 if resuming else 2)  # ONE_RANK or the config's
    # export.every_save: the adapter at step 2 too, to show the steps after it moved it
    result = run(straight, *COMMON, *extra, *saving, "export.every_save=true")
    assert result.returncode == 0, result.stderr[-4000:]
    checkpoint = straight / EXP / "checkpoints" / SAVED
    record = json.loads((checkpoint / "actor_train" / "engine" / "engine.json").read_text())
    rows = record["per_device_train_batch_size"] * record["gradient_accumulation_steps"]
    assert (record["dp_world_size"], rows * saved_ranks) == (saved_ranks, 16)
    result = run(resumed, *COMMON, *extra, *resuming, f"resume_from_checkpoint={checkpoint}")
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stdout + result.stderr
    assert f"saved on {saved_ranks} actor_train data-parallel ranks and resumes on {ranks}" in log
    assert "keeping the global batch" not in log  # the overrides kept it: nothing rescaled
    assert (checkpoint / "actor_train" / "engine_universal").is_dir()  # converted, kept
    return straight, resumed


def _rollouts(out_dir: Path, after: int) -> list[dict]:
    """The samples of the steps after ``after``, in order: prompt id, response, reward."""
    lines = (out_dir / EXP / "rollouts.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["step"] > after]


def _adapter(out_dir: Path, step: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(out_dir / EXP / "hf" / step / "adapter" / "adapter_model.safetensors")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(abs(a[k] - b[k]).max()) for k in a)


def _sampled(key: str) -> bool:
    """A metric of what the engines sampled and the rewards scored (exact), not of the trainer's
    log-probs beside vLLM's (``rollout/mismatch_*``: a forward over other micro-batches)."""
    return key.startswith("rollout/") and not key.startswith("rollout/mismatch_")


def _assert_continues(reference: Path, resumed: Path, saved_by: Path, exact: bool = False) -> dict:
    """The resumed run's steps 3 and 4 are ``reference``'s (the module docstring says what is
    exact and what within tolerance; ``exact``: all of it); ``saved_by`` wrote the checkpoint.
    Returns the resumed run's rows by step."""
    want, got = _rollouts(reference, 2), _rollouts(resumed, 2)
    assert {r["step"] for r in want} == {3, 4}
    assert got == want  # same prompts in the same order, same responses, same rewards

    rows = {r["step"]: r for r in metrics(resumed)}
    ref = {r["step"]: r for r in metrics(reference)}
    assert {3, 4} <= set(ref) and sorted(rows) == [3, 4]
    for step in (3, 4):
        kept = {k: v for k, v in ref[step].items() if not is_volatile(k)}
        assert kept.keys() == {k for k in rows[step] if not is_volatile(k)}, step
        for key, value in kept.items():
            if exact or _sampled(key):
                assert rows[step][key] == value, (step, key)
            else:  # what the trainer computed: fp32 reduction order
                assert rows[step][key] == pytest.approx(value, rel=LOSS_REL, abs=LOSS_ABS), (
                    step,
                    key,
                )

    after = _adapter(resumed, "step_000004")
    diff = _max_diff(after, _adapter(reference, "step_000004"))
    moved = _max_diff(after, _adapter(saved_by, SAVED))
    print(f"adapter after step 4: {diff:.1e} from the reference's; steps 3-4 moved it {moved:.1e}")
    assert diff <= (0.0 if exact else WEIGHT_TOL)
    assert moved > 10 * WEIGHT_TOL  # the steps moved the weights: the comparison can fail
    return rows


@pytest.mark.slow
def test_pipeline_resumes_on_one_rank_as_on_two(tmp_path: Path):
    """Also a third run, resumed from the same checkpoint on the same 2 ranks: it equals the
    saving run exactly, and the 1-rank run equals it as above."""
    straight, one_rank = _straight_and_resumed(tmp_path)
    two_ranks = tmp_path / "two_ranks_resumed"
    checkpoint = straight / EXP / "checkpoints" / SAVED
    result = run(two_ranks, *COMMON, f"resume_from_checkpoint={checkpoint}")
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_continues(straight, two_ranks, straight, exact=True)
    _assert_continues(two_ranks, one_rank, straight)


@pytest.mark.slow
def test_pipeline_saved_on_one_rank_resumes_on_two(tmp_path: Path):
    """The other way: saved by 1 rank of 2 accumulated micro-batches, resumed on the config's
    2 ranks of 1."""
    saving, resumed = _straight_and_resumed(tmp_path, saving=ONE_RANK, resuming=())
    _assert_continues(saving, resumed, saving)


def test_async_pipeline_resumes_on_one_rank_with_its_batch_in_flight(tmp_path: Path):
    """mode batch, one step ahead: step 3's batch, generated by the 2-rank run's engines while
    step 2 trained, is in the checkpoint; the 1-rank run trains on it."""
    straight, resumed = _straight_and_resumed(tmp_path, *ASYNC)
    assert (straight / EXP / "checkpoints" / SAVED / "rollouts_in_flight.json").is_file()
    rows = _assert_continues(straight, resumed, straight)
    assert [rows[s]["rollout/staleness"] for s in (3, 4)] == [1.0, 1.0]
