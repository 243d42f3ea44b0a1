"""A weight sync's bound scales with its bytes (``SyncBound``, the trainer's ``sync_numels`` /
``sync_nbytes``), and a sync that fails or times out names what broke it (``stuck_workers``):
the dead or raising ranks, else the side that stopped answering, never the ranks that only waited
on it; the driver restarts the run when that is a trainer rank. The same against real Ray actors
and the real collective: tests/integration/test_weight_sync.py."""

from __future__ import annotations

import pytest
import torch

from roll_ds.config.schema import WeightSyncConfig
from roll_ds.config.validate import ConfigError, validate
from roll_ds.distributed.errors import WorkerError, WorkerTimeoutError
from roll_ds.models.weights import iter_adapter_buckets, iter_weight_buckets, sync_numels
from roll_ds.pipeline.restarts import failed_trainer
from roll_ds.weight_sync import TRANSPORTS
from roll_ds.weight_sync.base import (
    GIB,
    SyncBound,
    TransferError,
    WeightSyncError,
    bucket_nbytes,
    cast_buckets,
    is_symptom,
    stuck_workers,
    sync_nbytes,
)

# --- the bound --------------------------------------------------------------------------------


def test_the_bound_is_the_timeout_plus_the_bytes_at_the_floor_throughput():
    bound = SyncBound(timeout_s=600.0, min_gib_per_s=0.05, nbytes=14 * GIB)  # a 7B bf16 model
    assert bound.seconds == pytest.approx(600.0 + 14 / 0.05)
    assert SyncBound(60.0, 2.0, GIB // 2).seconds == pytest.approx(60.25)


def test_without_a_floor_or_bytes_the_bound_is_the_timeout_alone():
    assert SyncBound(600.0).seconds == 600.0
    assert SyncBound(600.0, 0.05, 0).seconds == 600.0  # bytes not known (connect, close)
    assert SyncBound(600.0, None, GIB).seconds == 600.0
    assert SyncBound(600.0).describe() == "600 s (weight_sync.timeout_s)"


def test_the_bound_message_names_the_bound_the_bytes_and_both_fields():
    text = SyncBound(timeout_s=10.0, min_gib_per_s=0.5, nbytes=3 * GIB).describe()
    assert text.startswith("16.0 s (")
    for part in ("weight_sync.timeout_s=10", "weight_sync.min_gib_per_s=0.5", str(3 * GIB)):
        assert part in text, text
    assert "3 GiB" in text


def test_a_transport_carries_the_bound_and_refuses_a_floor_of_zero():
    cls = TRANSPORTS.get("object_store")
    transport = cls(bucket_bytes=1024, timeout_s=5.0, min_gib_per_s=1.0)
    assert transport.bound.seconds == 5.0  # no bytes yet
    transport.sync_bytes = GIB
    assert transport.bound.seconds == pytest.approx(6.0)
    with pytest.raises(ValueError, match=r"weight_sync.min_gib_per_s must be > 0, got 0"):
        cls(bucket_bytes=1024, timeout_s=5.0, min_gib_per_s=0)


def test_config_validation_refuses_a_floor_of_zero_naming_the_field():
    from roll_ds.config.schema import RLVRConfig

    with pytest.raises(ConfigError, match=r"weight_sync.min_gib_per_s"):
        validate(RLVRConfig(weight_sync=WeightSyncConfig(min_gib_per_s=0.0)))


# --- the bytes --------------------------------------------------------------------------------


def test_sync_nbytes_counts_each_dtype_at_the_dtype_it_travels_in():
    numels = {torch.float32: 1000, torch.bfloat16: 10, torch.int64: 3}
    assert sync_nbytes(numels, None) == 4000 + 20 + 24
    assert sync_nbytes(numels, "bf16") == 2000 + 20 + 24  # fp32 cast down; ints keep theirs
    assert sync_nbytes(numels, "fp32") == 4000 + 20 + 24  # bf16 is sent as bf16 (exact upcast)


def _tiny_qwen2(lora: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("rollout_dtype", [None, "bf16"])
def test_the_counted_bytes_are_what_the_buckets_carry(lora, rollout_dtype):
    """Counted without gathering, equal to the bytes of the buckets a sync sends (the tied
    output embedding an alias, counted once), merged or adapter alone."""
    model = _tiny_qwen2(lora)
    buckets = list(cast_buckets(iter_weight_buckets(model, 1 << 30), rollout_dtype))
    assert len(buckets) == 1  # one bucket: aliases within it are counted once, as sent
    counted = sync_nbytes(sync_numels(model, adapter_only=False), rollout_dtype)
    assert counted == bucket_nbytes(buckets[0])
    if lora:
        adapter = list(cast_buckets(iter_adapter_buckets(model, 1 << 30), rollout_dtype))
        counted = sync_nbytes(sync_numels(model, adapter_only=True), rollout_dtype)
        assert counted == sum(bucket_nbytes(b) for b in adapter)
        assert 0 < counted < sync_nbytes(sync_numels(model, adapter_only=False), rollout_dtype)


# --- what broke a sync --------------------------------------------------------------------------

METHODS = {"actor_train": "publish_weights", "actor_infer": "receive_weights"}


class TaskError(Exception):
    """Stands in for Ray's RayTaskError: the worker's own exception as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def waited(role: str, rank: int = 0) -> WorkerError:
    """``role``'s rank whose group operation timed out waiting on a peer."""
    text = f"weight-sync group rank {rank}/2: header of bucket 0 failed or timed out"
    return WorkerError(role, rank, METHODS[role], TaskError(TransferError(text)))


def raised(role: str, rank: int = 0) -> WorkerError:
    return WorkerError(role, rank, METHODS[role], TaskError(KeyError("no such weight")))


def stuck(busy, errors=()):
    return [
        (type(c).__name__, c.role, getattr(c, "ranks", None))
        for c in stuck_workers(busy, errors, METHODS, 3.0, upstream="actor_train")
    ]


def test_a_group_operation_that_timed_out_is_a_symptom():
    assert is_symptom(waited("actor_infer"))
    assert not is_symptom(raised("actor_infer"))
    assert not is_symptom(WorkerTimeoutError("actor_infer", "receive_weights", [0], 3.0))


def test_a_trainer_rank_that_stopped_is_named_not_the_engines_waiting_on_it():
    # the engines' header wait timed out in the group; the trainer never returned
    assert stuck({"actor_train": [0, 1]}, [waited("actor_infer")]) == [
        ("WorkerTimeoutError", "actor_train", [0, 1])
    ]
    # nobody's group operation gave up yet: the sender is upstream of everyone
    assert stuck({"actor_train": [1], "actor_infer": [0]}) == [
        ("WorkerTimeoutError", "actor_train", [1])
    ]


def test_an_engine_that_stopped_is_named_not_the_trainer_waiting_on_it():
    # rank 0's broadcast timed out (the receiver never took it): the busy receiver is stuck,
    # also while rank 1 still waits in the next gather for rank 0
    busy = {"actor_train": [1], "actor_infer": [0]}
    assert stuck(busy, [waited("actor_train")]) == [("WorkerTimeoutError", "actor_infer", [0])]
    # the sender finished (its data fit the socket buffers); only the receiver is busy
    assert stuck({"actor_infer": [1]}) == [("WorkerTimeoutError", "actor_infer", [1])]


def test_a_rank_that_died_or_raised_is_the_cause_whoever_else_waited():
    assert stuck({"actor_train": [1]}, [waited("actor_train"), raised("actor_infer", 1)]) == [
        ("WorkerError", "actor_infer", None)
    ]
    assert stuck({}, [waited("actor_train")]) == []  # nothing else known: the failures speak


def test_a_sync_stuck_in_the_trainer_restarts_the_run_and_one_stuck_in_an_engine_does_not():
    """restarts.failed_trainer reads ``causes``: a trainer that only waited on a dead engine
    (its broadcast broke) is not restarted for, a stuck trainer is."""
    busy, errors = {"actor_train": [0]}, [waited("actor_infer")]
    causes = stuck_workers(busy, errors, METHODS, 3.0, upstream="actor_train")
    error = WeightSyncError("weight sync (collective) timed out", (waited("actor_infer"),), causes)
    assert failed_trainer(error) == "actor_train ranks [0]"

    dead_engine = raised("actor_infer")
    error = WeightSyncError("failed", (waited("actor_train"), dead_engine), (dead_engine,))
    assert failed_trainer(error) is None
