"""Each bad input is reported with the field and the fix, all problems at once."""

import json
import subprocess
import sys

import pytest
from _config_problems import only, problems

from roll_ds.config import ConfigError, load_config
from roll_ds.config.compose import PROJECT_ROOT


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
    assert msg == "critic.model_args.lora_rank: must be >= 1 (or null: no LoRA), got 0"


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


# --- cross-field rules ------------------------------------------------------------------------


def test_max_model_len_shorter_than_prompt_plus_response():
    msg = only("actor_infer.strategy_args.strategy_config.max_model_len=32")
    assert msg == (
        "actor_infer.strategy_args.strategy_config.max_model_len: 32 is shorter than the longest "
        "sequence (prompt_length 32 + response_length 8 = 40 tokens); remove it (or set it to "
        "null) and the engine gets 40, raise it to at least 40, or lower prompt_length / "
        "response_length"
    )


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        ("agentic_lora_zero3", ["prompt_length=96"]),  # a longer first observation
        ("rlvr_lora_zero3", ["prompt_length=100"]),
        (
            "rlvr_lora_zero3",
            ["response_length=40", "actor_infer.generating_args.max_new_tokens=40"],
        ),
    ],
)
def test_raising_the_lengths_alone_validates(config, overrides):
    # The rollout engine's max_model_len is derived from them (the vllm strategy's), unless
    # strategy_config sets it: no second edit.
    cfg = load_config(config, overrides, check_files=False)
    assert cfg.actor_infer.strategy_args.strategy_config["max_model_len"] is None


def test_an_explicit_max_model_len_still_has_to_hold_the_raised_lengths():
    found = problems(
        "prompt_length=96",
        "actor_infer.strategy_args.strategy_config.max_model_len=192",
        config="agentic_lora_zero3",
    )
    assert found == [
        "actor_infer.strategy_args.strategy_config.max_model_len: 192 is shorter than the longest "
        "sequence (prompt_length 96 + response_length 160 = 256 tokens); remove it (or set it to "
        "null) and the engine gets 256, raise it to at least 256, or lower prompt_length / "
        "response_length"
    ]


def test_max_model_len_counts_the_evaluation_length():
    set_64 = "actor_infer.strategy_args.strategy_config.max_model_len=64"
    msg = only("validation.generating_args.max_new_tokens=40", set_64)
    assert "prompt_length 32 + validation.generating_args.max_new_tokens 40 = 72 tokens" in msg
    load_config(  # no evaluation: its length does not count
        "rlvr_lora_zero3",
        ["validation.generating_args.max_new_tokens=40", "eval_steps=0", set_64],
        check_files=False,
    )


def test_prompt_plus_response_beyond_the_models_positions(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    monkeypatch.chdir(PROJECT_ROOT)  # the data files are relative to the project
    overrides = [f"pretrain={tmp_path}"]
    load_config("rlvr_lora_zero3", overrides)  # 32 + 8 fits in 64
    with pytest.raises(ConfigError) as info:
        load_config("rlvr_lora_zero3", [*overrides, "prompt_length=60"])
    assert info.value.problems == [
        "prompt_length + response_length: the longest sequence (prompt_length 60 + "
        "response_length 8 = 68 tokens), the rollout engine's max_model_len, exceeds the model's "
        f"max_position_embeddings 64 ({tmp_path}/config.json); lower prompt_length / "
        "response_length"
    ]


def test_rollout_max_new_tokens_beyond_response_length():
    msg = only("actor_infer.generating_args.max_new_tokens=16")
    assert msg.startswith("actor_infer.generating_args.max_new_tokens: 16 > response_length 8;")
    assert "set it to ${response_length} or null" in msg


def test_overlong_buffer_beyond_response_length():
    msg = only("algorithm.overlong_buffer_len=9")
    assert msg.startswith("algorithm.overlong_buffer_len: 9 > response_length 8;")
    load_config("rlvr_lora_zero3", ["algorithm.overlong_buffer_len=8"], check_files=False)


@pytest.mark.parametrize("target", ["q_proj,embed_tokens", "lm_head", "transformer.wte"])
def test_lora_on_embeddings_is_rejected(target):
    msg = only(f"actor_train.model_args.lora_target='{target}'")
    assert msg.startswith(f"actor_train.model_args.lora_target: LoRA on {target.split(',')[-1]}")
    assert "is not merged into the weights synced to the rollout engine" in msg
    assert "remove it from lora_target" in msg


def test_lora_on_embeddings_of_a_critic_is_allowed():
    load_config(
        "rlvr_ppo_gae_zero3",
        ["critic.model_args.lora_rank=8", "critic.model_args.lora_target='embed_tokens,q_proj'"],
        check_files=False,
    )


def test_empty_lora_target():
    msg = only("actor_train.model_args.lora_target=''")
    assert msg.startswith("actor_train.model_args.lora_target: empty; use 'all-linear'")


def test_vllm_kwargs_the_strategy_owns():
    msg = only("+actor_infer.strategy_args.strategy_config.seed=1")
    assert msg == (
        "actor_infer.strategy_args.strategy_config.seed: the vllm strategy sets it; remove it "
        "(set the pipeline's seed instead)"
    )


def test_deepspeed_preset_values():
    msg = only("deepspeed_zero3.zero_optimization.reduce_bucket_size=0")
    assert msg == (
        "actor_train.strategy_args.strategy_config.zero_optimization.reduce_bucket_size: must be "
        "a number >= 1, got 0"
    )


def test_a_preset_that_is_not_pulled_in():
    msg = only("actor_train.strategy_args.strategy_config=${deepspeed_zero4}")
    assert msg.startswith(
        "actor_train.strategy_args.strategy_config: Interpolation key 'deepspeed_zero4' not found; "
        "the DeepSpeed presets this config pulls in are ${deepspeed_zero}, ${deepspeed_zero2}, "
    )


def test_keys_added_with_plus_that_the_schema_lacks():
    found = problems("+actor_train.training_args.learnin_rate=1", "+algorithm.bar=1")
    assert found == [
        "algorithm.bar: not a key of AlgorithmConfig; remove it (a `+` override adds keys that "
        "nothing reads)",
        "actor_train.training_args.learnin_rate: not a key of TrainingArgs; did you mean "
        "actor_train.training_args.learning_rate?; remove it (a `+` override adds keys that "
        "nothing reads)",
    ]


def test_domain_scored_by_two_reward_roles():
    msg = only("rewards.reverse.tag_included=[math,reverse]")
    assert msg == (
        "rewards.reverse.tag_included: domain 'math' is also in rewards.math.tag_included; score "
        "each domain with one role"
    )


def test_domain_interleave_probs():
    msg = only("actor_train.data_args.domain_interleave_probs={math:-1,reverse:1}")
    assert msg.startswith(
        "actor_train.data_args.domain_interleave_probs: weights must be >= 0 with a positive sum"
    )
    msg = only("+actor_train.data_args.domain_interleave_probs.code=0.5")
    assert msg == (
        "actor_train.data_args.domain_interleave_probs: domains ['code'] are scored by no reward "
        "role; add them to a rewards.<name>.tag_included"
    )


def test_evaluation_without_held_out_data():
    msg = only("validation.data_args.file_name=[]")
    assert msg == (
        "validation.data_args.file_name: eval_steps=10 evaluates on held-out data but no file is "
        "listed; list jsonl files or set eval_steps=0"
    )
    load_config(
        "rlvr_lora_zero3", ["validation.data_args.file_name=[]", "eval_steps=0"], check_files=False
    )


def test_cli_zero_micro_batch_without_traceback():
    result = run_cli("actor_train.training_args.per_device_train_batch_size=0")
    assert result.returncode == 2, result.stderr
    assert "per_device_train_batch_size: must be >= 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_async_generation_values():
    assert only("async_generation.max_staleness=-1") == (
        "async_generation.max_staleness: must be >= 0 (0: the synchronous loop), got -1"
    )
    assert only("algorithm.old_logprobs=cached") == (
        "algorithm.old_logprobs: 'cached' is not one of recompute, rollout, auto"
    )
    msg = only("async_generation.max_staleness=1", "algorithm.dynamic_sampling=true")
    assert "dynamic_sampling" in msg and "max_staleness=0" in msg
    load_config("rlvr_lora_zero3", ["async_generation.max_staleness=2"], check_files=False)


def test_async_generation_stream_mode():
    assert only("async_generation.mode=queue") == (
        "async_generation.mode: unknown mode 'queue'; valid: batch, stream"
    )
    msg = only("async_generation.mode=stream")
    assert "max_staleness >= 1" in msg
    msg = only(
        "async_generation.mode=stream",
        "async_generation.max_staleness=1",
        "weight_sync.lora_sync=adapter",
    )
    assert "lora_sync=merged" in msg
    stream = ["async_generation.mode=stream", "async_generation.max_staleness=2"]
    load_config("rlvr_lora_zero3", stream, check_files=False)


def test_held_out_only_episodes_are_checked():
    """Environment episodes in evaluation only (no training tags): the agentic checks still
    run (they were skipped, and a tag naming no environment was accepted)."""
    assert problems("val_env_manager.tags=[Nope]", "val_env_manager.num_env_groups=4") == [
        "val_env_manager.tags: ['Nope'] are not in custom_envs (defined: none); add them there "
        "or fix the tag"
    ]
    rows_only = "train_env_manager.tags=[]"  # the mixed config's rows, its held-out episodes
    found = problems(
        rows_only, "custom_envs.Calculator.max_tokens_per_step=0", config="rlvr_mixed_calculator"
    )
    assert found == ["custom_envs.Calculator.max_tokens_per_step: 0; must be >= 1"]
    load_config("rlvr_mixed_calculator", [rows_only], check_files=False)


def test_prompt_plus_response_beyond_an_embedded_models_positions():
    """The same check for an ``embedded:`` model (its shipped config.json, 256 positions): it
    was skipped, and vLLM's refusal reached the user as "ValidationError isn't serializable"
    after every role had started."""
    assert only("prompt_length=250") == (
        "prompt_length + response_length: the longest sequence (prompt_length 250 + "
        "response_length 8 = 258 tokens), the rollout engine's max_model_len, exceeds the "
        "model's max_position_embeddings 256 (embedded:tiny-qwen2's config.json); lower "
        "prompt_length / response_length"
    )
    load_config("rlvr_lora_zero3", ["prompt_length=248"], check_files=False)  # 256: fits
