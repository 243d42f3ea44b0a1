"""The colocation choreography (roll_ds/pipeline/colocation/): who is managed, in which order
roles start, the transitions of each phase, the trace, the orders that raise, validation, and
what DeepSpeed's offload_states can move per ZeRO setup. A fake runner stands in for the
roles' Ray actors."""

from __future__ import annotations

import json

import pytest

from roll_ds.config import ConfigError, load_config
from roll_ds.pipeline.colocation.choreography import (
    GENERATE,
    SYNC,
    TRAIN,
    Choreography,
    ColocationError,
    ColocationState,
    Transition,
    phase_transitions,
)
from roll_ds.pipeline.colocation.plan import ColocationPlan, plan_colocation
from strategies.deepspeed.offload import OFFLOAD_STATES, offload_targets

GPU_16 = "rlvr_qwen2.5_7b_lora_zero3_16gpu"


def config(*overrides: str, name: str = "rlvr_lora_zero3"):
    return load_config(name, list(overrides), check_files=False)


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config(*overrides)
    return info.value.problems


class FakeRoles:
    """The Runner boundary: records each stage of calls, and what every role holds, the way the
    strategies track it (vLLM refuses to generate or receive while asleep)."""

    def __init__(self) -> None:
        self.stages: list[list[tuple[str, str, dict]]] = []

    def __call__(self, stage: list[Transition]) -> None:
        self.stages.append([(t.role, t.method, dict(t.kwargs)) for t in stage])


# --- the plan -------------------------------------------------------------------------------


def test_auto_on_cpu_manages_nothing_and_starts_everything_at_once():
    """The default CPU run: device ids are CPU slots (one host memory), so nothing changes."""
    plan = plan_colocation(config(), "CPU")
    assert not plan.active and plan.late_start == ()
    roles = ["actor_train", "actor_infer", "rewards.math"]
    assert plan.start_stages(roles) == [roles]


def test_auto_on_shared_gpus_manages_the_16_gpu_example():
    plan = plan_colocation(config(name=GPU_16), "GPU")
    assert plan.engines == ("actor_infer",)
    assert plan.trainers == ("actor_train",)
    assert plan.sleep_level == 1
    roles = ["actor_train", "actor_infer", "rewards.math"]
    assert plan.start_stages(roles) == [["actor_infer", "rewards.math"], ["actor_train"]]


def test_auto_on_separate_gpus_manages_nothing():
    cfg = config(
        'actor_train.device_mapping="[0,1]"',
        'actor_infer.device_mapping="[2]"',
        "num_gpus_per_node=4",
    )
    plan = plan_colocation(cfg, "GPU")
    assert not plan.active and plan.late_start == ()


def test_only_roles_that_share_the_engines_gpus_are_managed():
    # rlvr_full_zero3: actor_train on 0-1, actor_infer on 0, the hf_infer reference on 1
    plan = plan_colocation(config(UTILIZATION, name="rlvr_full_zero3"), "GPU")
    assert plan.trainers == ("actor_train",)
    assert plan.start_stages(["actor_train", "actor_infer", "reference"]) == [
        ["actor_infer", "reference"],
        ["actor_train"],
    ]


UTILIZATION = "+actor_infer.strategy_args.strategy_config.gpu_memory_utilization=0.5"


def test_shared_gpus_refuse_vllms_empty_gpu_default_naming_what_stays_and_a_value():
    """vLLM's 0.9 is sized on an empty GPU; beside a colocated ZeRO-3 trainer with torch's
    AdamW (no optimizer section) the master weights and Adam states stay resident."""
    with pytest.raises(ValueError, match="gpu_memory_utilization") as info:
        plan_colocation(config(name="rlvr_full_zero3"), "GPU")
    message = str(info.value)
    assert "Adam states" in message and "CUDA context" in message, message
    assert "gpu_memory_utilization=0.70" in message, message
    assert plan_colocation(config(UTILIZATION, name="rlvr_full_zero3"), "GPU").active
    assert not plan_colocation(config(name="rlvr_full_zero3"), "CPU").late_start  # CPU: no check


def test_a_cuda_run_is_refused_at_validation_and_a_static_split_lists_every_state():
    errors = problems(
        "device=cuda", 'actor_train.device_mapping="[0]"', 'actor_infer.device_mapping="[0]"'
    )
    assert any("gpu_memory_utilization is unset" in p for p in errors), errors
    static = problems(
        "device=cuda",
        "colocation.offload=never",
        'actor_train.device_mapping="[0]"',
        'actor_infer.device_mapping="[0]"',
    )
    assert any("nothing is offloaded" in p for p in static), static
    cfg = config(  # with the value set the same layout validates
        "device=cuda",
        UTILIZATION,
        'actor_train.device_mapping="[0]"',
        'actor_infer.device_mapping="[0]"',
    )
    assert cfg.actor_infer.strategy_args.strategy_config["gpu_memory_utilization"] == 0.5


def test_always_manages_every_model_role_even_on_cpu():
    plan = plan_colocation(config("colocation.offload=always", name="rlvr_ppo_gae_zero3"), "CPU")
    assert plan.engines == ("actor_infer",)
    assert plan.trainers == ("actor_train", "critic")


def test_never_and_async_keep_a_static_split_but_still_start_the_engines_first():
    for cfg in (
        config("colocation.offload=never", name=GPU_16),
        config("async_generation.max_staleness=1", name=GPU_16),
    ):
        plan = plan_colocation(cfg, "GPU")
        assert not plan.active
        assert plan.late_start == ("actor_train",)
        assert "nothing is offloaded" in plan.notes[0]


# --- hf_infer as the rollout engine ----------------------------------------------------------

HF_ON_GPU_0 = (  # scripts/gpu/check.sh's run: both roles on the one GPU
    "actor_infer.strategy_args.strategy_name=hf_infer",
    "num_gpus_per_node=1",
    'actor_train.device_mapping="[0]"',
    'actor_infer.device_mapping="[0]"',
)


def test_hf_infer_sharing_a_gpu_is_managed_without_vllms_memory_checks():
    """hf_infer sleeps (StrategySpec.sleeps) but takes no share of the GPU at start: no
    gpu_memory_utilization is asked for, neither at the start nor at validation."""
    plan = plan_colocation(config(*HF_ON_GPU_0), "GPU")
    assert plan.engines == ("actor_infer",) and plan.trainers == ("actor_train",)
    assert plan.start_stages(["actor_train", "actor_infer"]) == [["actor_infer"], ["actor_train"]]
    cfg = config(*HF_ON_GPU_0, "device=cuda")
    assert "gpu_memory_utilization" not in cfg.actor_infer.strategy_args.strategy_config
    # vLLM's switch of its own sleep mode means nothing to hf_infer
    config(*HF_ON_GPU_0, "+actor_infer.strategy_args.strategy_config.enable_sleep_mode=false")


def test_hf_infer_on_cpu_is_managed_only_with_always():
    assert not plan_colocation(config(*HF_ON_GPU_0), "CPU").active
    plan = plan_colocation(config(*HF_ON_GPU_0, "colocation.offload=always"), "CPU")
    assert plan.engines == ("actor_infer",) and plan.trainers == ("actor_train",)


def test_always_needs_a_backend_that_sleeps(monkeypatch):
    from dataclasses import replace

    from roll_ds.config.strategies import STRATEGY_SPECS

    spec = STRATEGY_SPECS["hf_infer"]
    monkeypatch.setitem(STRATEGY_SPECS, "hf_infer", replace(spec, sleeps=False))
    (msg,) = problems(*HF_ON_GPU_0, "colocation.offload=always")
    assert "strategy_name one of vllm (got 'hf_infer')" in msg, msg
    assert not plan_colocation(config(*HF_ON_GPU_0), "GPU").active  # nothing to sleep


# --- transitions ----------------------------------------------------------------------------

PLAN = ColocationPlan(engines=("actor_infer",), trainers=("actor_train", "critic"))


def actions(stages: list[list[Transition]]) -> list[list[tuple[str, str]]]:
    return [[(t.role, t.action) for t in stage] for stage in stages]


def test_each_phase_frees_before_it_allocates():
    state = ColocationState.started(PLAN)
    state.awake["actor_infer"] = frozenset()  # after start: the engine sleeps
    assert actions(phase_transitions(PLAN, state, SYNC)) == [
        [("critic", "offload")],
        [("actor_infer", "wake_weights")],
    ]
    state.loaded["critic"] = False
    state.awake["actor_infer"] = frozenset({"weights"})
    assert actions(phase_transitions(PLAN, state, GENERATE)) == [
        [("actor_train", "offload")],
        [("actor_infer", "wake_kv_cache")],
    ]
    state.loaded["actor_train"] = False
    state.awake["actor_infer"] = frozenset({"weights", "kv_cache"})
    assert actions(phase_transitions(PLAN, state, TRAIN)) == [
        [("actor_infer", "sleep")],
        [("actor_train", "reload"), ("critic", "reload")],
    ]


def test_sync_from_generate_sleeps_the_kv_cache_away_before_the_trainer_returns():
    state = ColocationState(
        loaded={"actor_train": False, "critic": False},
        awake={"actor_infer": frozenset({"weights", "kv_cache"})},
    )
    assert actions(phase_transitions(PLAN, state, SYNC)) == [
        [("actor_infer", "sleep")],
        [("actor_train", "reload"), ("actor_infer", "wake_weights")],
    ]


def test_transition_calls_carry_the_strategies_arguments():
    plan = ColocationPlan(engines=("actor_infer",), sleep_level=2)
    awake = ColocationState(loaded={}, awake={"actor_infer": frozenset({"weights", "kv_cache"})})
    assert phase_transitions(plan, awake, TRAIN) == [
        [Transition("actor_infer", "sleep", "offload_states", {"level": 2})]
    ]
    asleep = ColocationState(loaded={}, awake={"actor_infer": frozenset()})
    assert phase_transitions(plan, asleep, GENERATE) == [
        [Transition("actor_infer", "wake", "reload_states")]  # weights and KV cache at once
    ]


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown colocation phase 'rollout'"):
        phase_transitions(PLAN, ColocationState.started(PLAN), "rollout")


# --- the state machine and its trace --------------------------------------------------------


def started(plan: ColocationPlan, **kwargs) -> tuple[Choreography, FakeRoles]:
    roles = FakeRoles()
    choreo = Choreography(plan, run=roles, **kwargs)
    for stage in choreo.start_stages(["actor_train", "critic", "actor_infer", "rewards.math"]):
        choreo.started(stage)
    return choreo, roles


def test_a_step_records_every_transition_in_order(tmp_path):
    plan = ColocationPlan(
        engines=("actor_infer",), trainers=("actor_train",), late_start=("actor_train",)
    )
    choreo, roles = started(plan, trace_path=tmp_path / "trace.jsonl")
    for step in (0, 1):
        choreo.enter(SYNC, step)
        choreo.synced(step)
        choreo.enter(GENERATE, step)
        choreo.enter(GENERATE, step)  # already there: nothing happens
        choreo.enter(TRAIN, step)
    step_trace = [
        ("pipeline", "sync"),
        ("actor_infer", "wake_weights"),
        ("actor_infer", "synced"),
        ("pipeline", "generate"),
        ("actor_train", "offload"),
        ("actor_infer", "wake_kv_cache"),
        ("pipeline", "train"),
        ("actor_infer", "sleep"),
        ("actor_train", "reload"),
    ]
    assert choreo.trace == [
        (None, "critic", "start"),
        (None, "actor_infer", "start"),
        (None, "rewards.math", "start"),
        (None, "actor_infer", "sleep"),
        (None, "actor_train", "start"),
        *[(0, role, action) for role, action in step_trace],
        *[(1, role, action) for role, action in step_trace],
    ]
    assert roles.stages[:3] == [
        [("actor_infer", "offload_states", {"level": 1})],
        [("actor_infer", "reload_states", {"tags": ["weights"]})],
        [("actor_train", "offload_states", {})],
    ]
    rows = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [tuple(r.values()) for r in rows] == [tuple(e) for e in choreo.trace]
    assert choreo.pop_seconds() >= 0 and choreo.seconds == 0


def test_the_roles_memory_after_each_transition_goes_to_metrics_and_the_trace(tmp_path):
    """On GPUs each rank returns its device memory from offload_states / reload_states: the
    largest over a role's ranks becomes colocation/<role>_<action>_<figure>_mib, and the trace
    line of the transition carries it; CPU ranks return None and add nothing."""
    gib = 2**30

    def runner(stage):
        out = []
        for t in stage:
            low = {"allocated": gib, "reserved": 2 * gib, "device_used": 3 * gib}
            high = {k: v + gib for k, v in low.items()}
            out.append([low, high] if t.role == "actor_train" else [None])
        return out

    plan = ColocationPlan(
        engines=("actor_infer",), trainers=("actor_train",), late_start=("actor_train",)
    )
    choreo = Choreography(plan, run=runner, trace_path=tmp_path / "trace.jsonl")
    choreo.started(["actor_infer"])
    choreo.started(["actor_train"])
    choreo.enter(SYNC, 0)
    choreo.synced(0)
    choreo.enter(GENERATE, 0)
    assert choreo.pop_memory() == {
        "colocation/actor_train_offload_allocated_mib": 2048.0,
        "colocation/actor_train_offload_reserved_mib": 3072.0,
        "colocation/actor_train_offload_device_used_mib": 4096.0,
    }
    assert choreo.pop_memory() == {}
    rows = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    offload = [r for r in rows if r["action"] == "offload"]
    assert offload == [
        {
            "step": 0,
            "role": "actor_train",
            "action": "offload",
            "memory_mib": {"allocated": 2048.0, "reserved": 3072.0, "device_used": 4096.0},
        }
    ]
    assert all("memory_mib" not in r for r in rows if r["role"] == "actor_infer")


def test_sync_into_sleeping_weights_raises():
    choreo, _ = started(PLAN)
    with pytest.raises(ColocationError, match="while its weights were asleep"):
        choreo.synced(0)


def test_entering_a_phase_before_every_role_started_raises():
    choreo = Choreography(PLAN, run=FakeRoles())
    choreo.started(["actor_infer"])
    with pytest.raises(ColocationError, match=r"before \['actor_train', 'critic'\] started"):
        choreo.enter(GENERATE, 0)


def test_level_2_discards_the_weights_until_a_sync_refills_them():
    plan = ColocationPlan(engines=("actor_infer",), trainers=("actor_train",), sleep_level=2)
    choreo, _ = started(plan)
    assert choreo.needs_sync  # the start-up sleep dropped the pretrained weights
    with pytest.raises(ColocationError, match=r"weights that colocation\.sleep_level=2 discarded"):
        choreo.enter(GENERATE, 0)
    choreo.enter(SYNC, 0)
    choreo.synced(0)
    assert not choreo.needs_sync
    choreo.enter(GENERATE, 0)
    choreo.enter(TRAIN, 0)
    assert choreo.needs_sync  # a checkpoint's TRAIN phase after eval: the pipeline re-syncs


def test_inactive_choreography_does_nothing():
    choreo = Choreography(ColocationPlan())  # no runner: any transition would raise
    choreo.started(["actor_train", "actor_infer"])
    for phase in (SYNC, GENERATE, TRAIN):
        choreo.enter(phase, 0)
    choreo.synced(0)
    assert [e.action for e in choreo.trace] == ["start", "start"]
    assert not choreo.needs_sync


# --- validation -----------------------------------------------------------------------------


def test_bad_values_name_the_field_and_the_valid_ones():
    found = problems("colocation.offload=sometimes", "colocation.sleep_level=3")
    assert "colocation.offload: 'sometimes' is not one of auto, always, never" in found
    assert "colocation.sleep_level: 3 is not one of 1, 2" in found


def test_level_2_with_adapter_sync_is_refused():
    (msg,) = problems("colocation.sleep_level=2", "weight_sync.lora_sync=adapter")
    assert msg.startswith("colocation.sleep_level: 2 discards vLLM's base weights")
    assert "weight_sync.lora_sync=merged" in msg


def test_always_offload_with_async_generation_is_refused():
    (msg,) = problems("colocation.offload=always", "async_generation.max_staleness=1")
    assert msg.startswith("colocation.offload: always offloads the trainer while")
    assert "async_generation.max_staleness=0" in msg


def test_sleep_mode_switched_off_is_refused_unless_offload_is_never():
    override = "+actor_infer.strategy_args.strategy_config.enable_sleep_mode=false"
    (msg,) = problems(override)
    assert msg.startswith("actor_infer.strategy_args.strategy_config.enable_sleep_mode: false")
    config(override, "colocation.offload=never")  # valid


def test_default_config_is_unchanged():
    cfg = config()
    assert (cfg.colocation.offload, cfg.colocation.sleep_level) == ("auto", 1)


# --- what DeepSpeed can move ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "offloaded", "optimizer", "moved", "kept"),
    [
        (0, {}, "AdamW", (), "ZeRO stage 0 has no offload_states"),
        (
            3,
            {"offload_param": "cpu", "offload_optimizer": "cpu"},
            "DeepSpeedCPUAdam",
            (),
            "nothing to move",
        ),
        (3, {}, "FusedAdam", OFFLOAD_STATES, ""),
        (
            3,
            {},
            "AdamW",
            ("lp_params", "lp_grads", "contiguous_grad_buffer"),
            "only for DeepSpeed's FusedAdam",
        ),
        (3, {"offload_optimizer": "cpu"}, "DeepSpeedCPUAdam", OFFLOAD_STATES, ""),
        (2, {}, "AdamW", OFFLOAD_STATES, ""),
        (1, {}, "FusedAdam", OFFLOAD_STATES, ""),
    ],
)
def test_offload_targets(stage, offloaded, optimizer, moved, kept):
    got_moved, got_kept = offload_targets(stage, offloaded, optimizer)
    assert got_moved == moved
    assert (kept in got_kept) if kept else got_kept == ""
