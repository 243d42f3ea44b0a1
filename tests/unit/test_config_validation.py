"""Each bad input is reported with the field and the fix, all problems at once."""

import subprocess
import sys

import pytest

from roll_ds.config import ConfigError, load_config
from roll_ds.config.compose import PROJECT_ROOT


def problems(*overrides: str, config: str = "rlvr_lora_zero3") -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, list(overrides), check_files=False)
    return info.value.problems


def only(*overrides: str) -> str:
    found = problems(*overrides)
    assert len(found) == 1, found
    return found[0]


def test_unknown_strategy_lists_valid_ones():
    msg = only("actor_train.strategy_args.strategy_name=megatron_train")
    assert msg.startswith("actor_train.strategy_args.strategy_name: unknown strategy_name")
    assert "'megatron_train'" in msg
    assert "deepspeed_train, hf_infer, vllm" in msg


def test_role_strategy_must_fit_the_role():
    msg = only("actor_infer.strategy_args.strategy_name=deepspeed_train")
    assert "cannot generate rollouts" in msg and "hf_infer, vllm" in msg


def test_zero_stage_4():
    msg = only("deepspeed_zero3.zero_optimization.stage=4")
    assert msg == (
        "actor_train.strategy_args.strategy_config.zero_optimization.stage: 4 is not a ZeRO "
        "stage; use one of 0, 1, 2, 3"
    )


@pytest.mark.parametrize("stage", [0, 1])
def test_offload_with_stage_0_or_1(stage):
    found = problems(
        "actor_train.strategy_args.strategy_config=${deepspeed_zero3_cpuoffload}",
        f"deepspeed_zero3_cpuoffload.zero_optimization.stage={stage}",
    )
    assert any("optimizer offload needs ZeRO stage 2 or 3" in p for p in found), found
    assert any("parameter offload needs ZeRO stage 3" in p for p in found), found


def test_batch_arithmetic_that_does_not_divide():
    msg = only("rollout_batch_size=5")
    assert "5 x 8 = 40 samples per step is not a multiple of actor_train's train batch" in msg
    assert "= 64); adjust one of them" in msg


def test_deepspeed_train_batch_size_mismatch():
    msg = only("deepspeed_zero3.train_batch_size=12")
    assert (
        "train_batch_size: 12 != micro batch 16 x accumulation 2 x data-parallel size 2 = 64" in msg
    )


def test_device_ids_beyond_cluster():
    # Hydra's override grammar has no list(); the ROLL-style string is passed quoted.
    msg = only('actor_infer.device_mapping="list(range(0,4))"')
    assert "actor_infer.device_mapping: device ids [2, 3] are beyond the cluster" in msg
    assert "num_nodes 1 x num_gpus_per_node 2 = 2 devices" in msg


def test_role_with_no_devices():
    msg = only("actor_infer.device_mapping=null")
    assert "actor_infer.world_size: a role without devices needs world_size >= 1" in msg or (
        "actor_infer.device_mapping: the role has no devices" in msg
    )
    msg = only("actor_infer.device_mapping=null", "actor_infer.world_size=1")
    assert msg.startswith("actor_infer.device_mapping: the role has no devices")


@pytest.mark.parametrize("bad", ["list(range(0,2)", "[0,x]", "0..2", "os.system"])
def test_malformed_device_mapping(bad):
    msg = only(f'actor_train.device_mapping="{bad}"')
    assert msg.startswith("actor_train.device_mapping:")


def test_world_size_must_agree_with_devices():
    msg = only("actor_train.world_size=3")
    assert "actor_train.world_size: 3 disagrees with device_mapping" in msg


def test_worker_devices_must_stay_on_one_node():
    msg = only(
        "num_gpus_per_node=1",
        "num_nodes=2",
        "actor_infer.device_mapping=[0,1]",
        "actor_infer.num_gpus_per_worker=2",
    )
    assert "span two nodes" in msg


def test_group_size_must_match_rollout_n():
    msg = only("actor_infer.generating_args.num_return_sequences=4")
    assert "num_return_sequences_in_group 8" in msg


def test_full_finetune_with_kl_needs_reference():
    msg = only("actor_train.model_args.lora_rank=null", "algorithm.kl_coef=0.1")
    assert msg.startswith("reference: algorithm.kl_coef > 0 needs reference log-probs")


def test_unknown_reward_function_is_named():
    msg = only("rewards.math.reward_fns=[{name: math_rul}]")
    assert msg.startswith("rewards.math.reward_fns[0]: unknown reward function 'math_rul'")
    assert "math_rule" in msg


def test_unknown_weight_sync_transport():
    msg = only("weight_sync.transport=nccl_p2p")
    assert msg.startswith("weight_sync.transport: 'nccl_p2p'; valid: auto, ")


def test_all_problems_reported_at_once():
    found = problems(
        "actor_train.strategy_args.strategy_name=nope",
        "actor_infer.device_mapping=[9]",
        "rollout_batch_size=3",
        "actor_train.model_args.dtype=fp8",
    )
    assert len(found) == 4, found


def gae_only(*overrides: str) -> str:
    found = problems(*overrides, config="rlvr_ppo_gae_zero3")
    assert len(found) == 1, found
    return found[0]


def test_gae_needs_a_critic():
    msg = only("algorithm.adv_estimator=gae")
    assert msg.startswith("critic: adv_estimator 'gae' needs a critic role (the value model)")
    assert "rlvr_ppo_gae_zero3.yaml" in msg


def test_unknown_estimator_lists_valid_ones():
    msg = only("algorithm.adv_estimator=ppo")
    assert msg == (
        "algorithm.adv_estimator: unknown advantage estimator 'ppo'; valid: dr_grpo, gae, grpo, "
        "reinforce_plus_plus, reinforce_plus_plus_baseline, rloo"
    )


def test_critic_must_train():
    msg = gae_only("critic.strategy_args.strategy_name=vllm")
    assert msg == (
        "critic.strategy_args.strategy_name: 'vllm' cannot train; use one of deepspeed_train"
    )


def test_critic_needs_a_deepspeed_config():
    msg = gae_only("critic.strategy_args.strategy_config=null")
    assert msg.startswith("critic.strategy_args.strategy_config: a DeepSpeed config is required")


def test_critic_batch_arithmetic_names_the_critic():
    msg = gae_only("critic.training_args.per_device_train_batch_size=24")
    assert "16 x 8 = 128 samples per step is not a multiple of critic's train batch" in msg
    assert (
        "critic.training_args: per_device_train_batch_size 24 x gradient_accumulation_steps 2"
        in msg
    )


def test_critic_devices_beyond_cluster():
    msg = gae_only("critic.device_mapping=[0,5]")
    assert msg.startswith("critic.device_mapping: device ids [5] are beyond the cluster")


def test_critic_lora_rank():
    msg = gae_only("critic.model_args.lora_rank=0")
    assert msg == "critic.model_args.lora_rank: must be >= 1 or null (no LoRA), got 0"


def test_algorithm_ranges():
    found = problems(
        "algorithm.ppo_epochs=0",
        "algorithm.gamma=1.5",
        "algorithm.lam=-0.1",
        "algorithm.value_clip=0",
        "algorithm.vf_coef=0",
        config="rlvr_ppo_gae_zero3",
    )
    assert found == [
        "algorithm.ppo_epochs: must be >= 1, got 0",
        "algorithm.gamma: must be in [0, 1], got 1.5",
        "algorithm.lam: must be in [0, 1], got -0.1",
        "algorithm.value_clip: must be > 0 (or null: no value clipping), got 0.0",
        "algorithm.vf_coef: must be > 0, got 0.0",
    ]


def test_missing_files_are_reported():
    with pytest.raises(ConfigError) as info:
        load_config(
            "rlvr_lora_zero3",
            ["pretrain=/nonexistent/model", "actor_train.data_args.file_name=[/nope.jsonl]"],
        )
    text = str(info.value)
    assert "pretrain: '/nonexistent/model' does not exist" in text
    assert "actor_train.data_args.file_name[0]: file '/nope.jsonl' not found" in text


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "run.py", "--config-name", "rlvr_lora_zero3", *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_reports_problems_without_traceback():
    result = run_cli("actor_train.strategy_args.strategy_name=nope", "rollout_batch_size=3")
    assert result.returncode == 2
    assert "invalid config (2 problem(s))" in result.stderr
    assert "unknown strategy_name 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_prints_the_zero_stage_override():
    result = run_cli(
        "--cfg", "job", "--resolve", "actor_train.strategy_args.strategy_config=${deepspeed_zero2}"
    )
    assert result.returncode == 0, result.stderr
    actor = result.stdout.split("\nactor_train:\n", 1)[1].split("\nactor_infer:\n", 1)[0]
    assert "stage: 2" in actor and "stage: 3" not in actor
