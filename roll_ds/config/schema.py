"""Typed schema of a roll_ds pipeline config.

Registered in Hydra's ConfigStore (see ``store.py``) and named first in every pipeline YAML's
``defaults`` list, so composition itself rejects misspelled keys and wrong types. This module
must stay importable without torch, Ray, DeepSpeed or vLLM
(``tests/unit/config/test_config_imports.py``).

Field names follow ROLL's so its DeepSpeed backend guide applies unchanged (``strategy_args``,
``device_mapping``, ``model_args``, ``training_args``, ``infer_batch_size``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from roll_ds.config.agentic import AgenticConfig, EnvManagerConfig, EnvSpecConfig
from roll_ds.config.fault_tolerance import FaultToleranceConfig

EMBEDDED_MODEL = "embedded:tiny-qwen2"
"""``pretrain`` of the tiny Qwen2 policy shipped with roll_ds (roll_ds/models/shipped.py)."""
EMBEDDED_RM = "embedded:tiny-rm"
"""``model_name_or_path`` of the embedded reward model (shipped, like the policy)."""
EMBEDDED_AGENT = "embedded:tiny-agent"
"""``pretrain`` of the embedded agent model (shipped, like the policy): the embedded
policy warmed up on episodes of the shipped environments, with a chat template."""

DTYPES = ("fp32", "bf16", "fp16")
# model_args.attn_implementation -> the name transformers reads (roll_ds/models/loading.py); fa2
# is ROLL's spelling of transformers' flash_attention_2, and both are taken.
FLASH_ATTENTION_2 = "flash_attention_2"
ATTN_IMPLEMENTATIONS = {
    None: None,
    "eager": "eager",
    "sdpa": "sdpa",
    "fa2": FLASH_ATTENTION_2,
    FLASH_ATTENTION_2: FLASH_ATTENTION_2,
}
FLASH_ATTENTION_DTYPES = ("bf16", "fp16")  # flash-attn has no fp32 kernels


@dataclass
class StrategyArgs:
    # Backend of the role, looked up in ``roll_ds.strategy.STRATEGIES`` (deepspeed_train, vllm...).
    # Null only for reward roles that score with rules on CPU.
    strategy_name: str | None = MISSING
    # Backend-specific settings: for deepspeed_* the DeepSpeed JSON, usually ``${deepspeed_zero3}``;
    # for vllm the keyword arguments of ``vllm.LLM`` (gpu_memory_utilization, ...).
    strategy_config: Any = None


@dataclass
class ModelArgs:
    # None: use the pipeline's top-level ``pretrain``.
    model_name_or_path: str | None = None
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    # None (transformers' default) | eager | sdpa | fa2 (= flash_attention_2: dtype bf16 or fp16)
    attn_implementation: str | None = None
    # false: recompute activations in the backward pass (less memory, slower; trainers only)
    disable_gradient_checkpointing: bool = True
    model_type: str | None = None  # kept for ROLL compatibility; only causal LMs are supported
    # LoRA (peft). lora_rank null disables LoRA.
    lora_rank: int | None = None
    lora_alpha: int | None = None  # default: 2 * lora_rank
    lora_dropout: float = 0.0  # LoRA dropout; nonzero: old log-probs get a pass of their own
    lora_target: str = "all-linear"  # "all-linear" or a comma list such as "q_proj,v_proj"


@dataclass
class TrainingArgs:
    learning_rate: float = 1.0e-6  # peak learning rate of the optimizer (AdamW)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.999  # Adam's second-moment decay
    adam_epsilon: float = 1.0e-8  # Adam's denominator epsilon
    # Rows per rank in one forward/backward (fills the DeepSpeed presets' "auto" micro batch).
    per_device_train_batch_size: int = 1
    # Micro-batches accumulated per optimizer step; micro x accumulation x ranks rows a step.
    gradient_accumulation_steps: int = 1
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to learning_rate
    lr_scheduler_type: str = "constant"  # constant | linear | cosine (decay to 0 over max_steps)
    max_grad_norm: float = 1.0  # gradient clipping by global norm (DeepSpeed gradient_clipping)
    num_train_epochs: int = 1  # kept for ROLL compatibility; pipelines stop at max_steps


@dataclass
class GeneratingArgs:
    max_new_tokens: int | None = None  # None: the pipeline's response_length
    temperature: float = 1.0  # sampling temperature; 0: greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest token set of this probability
    top_k: int = -1  # keep the k likeliest tokens; -1 or 0: off
    num_return_sequences: int = 1  # samples per prompt (rollouts: the GRPO group)
    # Sampling seed where the caller passes none (the pipeline seeds every rollout from the
    # top-level seed and the step); null: unseeded.
    seed: int | None = None


@dataclass
class DataArgs:
    # Task files (.jsonl, .json, .parquet) or directories of them; relative paths are resolved
    # against the directory run.py was started from. .jsonl is read line by line by roll_ds,
    # .json / .parquet by `datasets` from local files (roll_ds/data/sources.py). Default rows:
    # {"prompt", "ground_truth", "domain"?, "id"?}; the keys below map other schemas.
    file_name: list[str] = field(default_factory=list)
    # raw: prompt text as is | chat: rendered with the chat template (needed for `messages`
    # prompts and system_prompt)
    template: str = "raw"
    # Key of the prompt: a string, or a chat `messages` list of {role, content}; a dotted key
    # (e.g. reward_model.ground_truth) reads a nested field.
    prompt_key: str = "prompt"
    answer_key: str = "ground_truth"  # key of the reference answer (a string)
    # How the answer is read: raw (as is) | gsm8k (the number after the last "####").
    answer_format: str = "raw"
    domain_key: str | None = "domain"  # key of the row's domain; null: every row default_domain
    default_domain: str = "math"  # domain of rows without a domain_key value
    system_prompt: str | None = None  # system message put before each prompt (template: chat)
    # null: the tokenizer's own chat template | chatml: a plain ChatML template (for tokenizers
    # without one, like the embedded model's) | any other string: a Jinja chat template.
    chat_template: str | None = None
    # Sampling weight of each domain when mixing prompts; empty: proportional to the data.
    domain_interleave_probs: dict[str, float] = field(default_factory=dict)
    max_samples: int | None = None  # read only the first max_samples rows; null: every row
    # Drop prompts longer than the pipeline's prompt_length (the count is logged) instead of
    # failing at start-up.
    filter_overlong_prompts: bool = False


@dataclass
class WorkerConfig:
    """One role: a group of Ray actors running one strategy."""

    # Global device ids: "list(range(0,16))", "[0,1,2]", "0-3" or a YAML list. Null: CPU-only
    # actors sized by world_size (reward workers).
    device_mapping: Any = None
    # Number of actors; null: one per device in device_mapping divided by num_gpus_per_worker.
    world_size: int | None = None
    # Devices each actor holds: a vLLM engine's tensor-parallel size (actor_infer).
    num_gpus_per_worker: int = 1
    strategy_args: StrategyArgs = field(default_factory=StrategyArgs)  # the backend
    model_args: ModelArgs = field(default_factory=ModelArgs)  # the model and its LoRA
    # The optimizer and batch shape (trainers: actor_train, critic).
    training_args: TrainingArgs = field(default_factory=TrainingArgs)
    # Sampling (actor_infer, a judge).
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    data_args: DataArgs = field(default_factory=DataArgs)  # training data (actor_train)
    # Rows per forward pass outside training (log-probs, reference, values, reward models).
    infer_batch_size: int = 8
    # Micro-batches of about this many real tokens instead of per_device_train_batch_size /
    # infer_batch_size rows (actor_train, reference, critic: train, log-prob, reference and value
    # passes): rows sorted by length, each micro-batch cut to its own longest row; null: by rows.
    # Must hold prompt_length + response_length. Optimizer steps stay micro x accumulation rows.
    max_tokens_per_micro_batch: int | None = None
    # Concatenate a micro-batch's sequences into one row without padding (position ids restart
    # per sequence, no attention mask); outputs equal the padded forward's (strategies/
    # micro_batches.py). Needs an attention implementation that masks by position ids.
    use_sequence_packing: bool = False
    # Ulysses sequence parallelism (actor_train, reference on deepspeed_train / deepspeed_infer):
    # groups of this many ranks compute each micro-batch together, each on 1/size of its tokens
    # (strategies/deepspeed/sequence_parallel.py); 1: off. Divides the role's world size and the
    # model's attention and key-value head counts; attention sdpa or fa2.
    sequence_parallel_size: int = 1
    # CPU threads each actor computes with; null: decided by roll_ds/threads.py (on CPU machines
    # from what runs at once, on GPUs the CPUs the actor reserved).
    num_threads: int | None = None
    # Extra environment variables for every actor of the role.
    system_envs: dict[str, str] = field(default_factory=dict)


@dataclass
class ScoreTransform:
    """A reward model's raw score -> its reward term: ``scale * (raw + shift)``, then squashed
    into (0, 1) by a sigmoid when ``sigmoid`` is true."""

    scale: float = 1.0  # multiplies raw + shift
    shift: float = 0.0  # added to the raw score before scaling
    sigmoid: bool = False  # squash the scaled score into (0, 1)


@dataclass
class JudgePattern:
    """One verdict rule of a generative judge: the first rule whose ``regex`` matches the
    verdict gives the score."""

    regex: str = MISSING  # Python regex, searched in the judge's generated text
    score: float | None = None  # None: the regex's first group, read as a number


@dataclass
class JudgeConfig:
    """A generative judge (reward fn ``judge``): the role's model (a causal LM) is prompted
    with ``template`` and its verdict parsed by ``patterns`` into a score."""

    # Placeholders: {question} and {response} (required), {reference} (the ground truth).
    template: str = MISSING
    # Verdict rules, tried in order; the default reads "incorrect"/"wrong" as 0, "correct" 1.
    patterns: list[JudgePattern] = field(
        default_factory=lambda: [
            JudgePattern(regex=r"(?i)\b(incorrect|wrong)\b", score=0.0),
            JudgePattern(regex=r"(?i)\bcorrect\b", score=1.0),
        ]
    )
    unparsed_score: float = 0.0  # score of a verdict no pattern matches (counted as unparsed)
    timeout_s: float = 120.0  # per judged batch; a batch past it scores unparsed_score


@dataclass
class RewardConfig(WorkerConfig):
    """A reward role for one or more data domains: rule functions on CPU workers, and optionally
    a model (``model_args`` + ``strategy_args``) serving a reward model (``head``) or a judge."""

    # The reward model's or judge's backend; strategy_name null: rules only, on CPU actors.
    strategy_args: StrategyArgs = field(default_factory=lambda: StrategyArgs(strategy_name=None))
    world_size: int | None = 1  # reward actors of the role (CPU workers for rules)

    # Domains (the rows' "domain" field) this reward worker group scores.
    tag_included: list[str] = field(default_factory=list)
    # Reward functions summed with weights, e.g. [{name: math_rule, weight: 1.0}]; `model` is
    # the role's reward model, `judge` its judge. A weight-0 term is computed and reported
    # (a rule's `correct` still gives the accuracy metrics) but does not move the score.
    reward_fns: list[dict[str, Any]] = field(default_factory=list)
    timeout_s: float = 5.0  # per-sample deadline of each reward function that takes one
    # Discriminative reward model: the head model_args' model is read with,
    # sequence_classification | value (strategy hf_infer or deepspeed_infer); null: none.
    head: str | None = None
    score_transform: ScoreTransform = field(default_factory=ScoreTransform)  # of `model` scores
    # The model's input text: raw (prompt + response) | chat (the model tokenizer's chat
    # template, user: prompt, assistant: response; for the judge, user: the filled template).
    input_template: str = "raw"
    judge: JudgeConfig | None = None  # generative judge (strategy vllm or hf_infer); null: none


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_plus_plus[_baseline] | gae
    # Passes of the train step over each rollout batch (old log-probs fixed before the first).
    ppo_epochs: int = 1
    whiten_advantages: bool = False  # whiten the final advantages over the batch (any estimator)
    gamma: float = 1.0  # discount: gae, reinforce_plus_plus[_baseline]
    lam: float = 1.0  # GAE lambda: gae
    # Critic (gae): value clipping around the rollout-time values (null: none), loss scale.
    value_clip: float | None = 0.5
    vf_coef: float = 1.0  # the critic's value-loss scale
    # Policy loss: PPO clip with asymmetric ("clip-higher") bounds, optional dual clip.
    clip_low: float = 0.2
    clip_high: float = 0.2  # upper clip: ratio <= 1 + clip_high (DAPO's clip-higher: 0.28)
    dual_clip: float | None = None  # dual-clip bound c > 1 for negative advantages; null: off
    ratio_level: str = "token"  # token | sequence (GSPO)
    # GSPO (ratio_level: sequence): the clip range of the sequence ratio, used instead of
    # clip_low / clip_high (the GSPO paper: 3e-4 / 4e-4).
    seq_clip_low: float = 3.0e-4
    seq_clip_high: float = 4.0e-4  # GSPO: the upper clip of the sequence ratio
    # How token losses become the batch's loss: token-mean | seq-mean-token-mean |
    # seq-mean-token-sum | seq-mean-token-sum-norm (over the whole mini-batch).
    loss_agg_mode: str = "token-mean"
    # KL to the reference policy: as a loss term (use_kl_loss) or a reward penalty (kl_in_reward).
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_coef: float = 0.0  # KL weight; 0: no KL and no reference log-probs
    use_kl_loss: bool = True  # KL as a term of the policy loss
    kl_in_reward: bool = False  # KL as a per-token penalty on the rewards instead
    entropy_coef: float = 0.0  # entropy bonus subtracted from the loss; 0: off
    # Rollout filtering and corrections.
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3  # dynamic_sampling only
    # Where PPO's old log-probs come from: recompute (a trainer forward over the batch every
    # step) | rollout (the rollout engine's sampled-token log-probs) | auto (rollout for an
    # on-policy batch when trainer and engine are fp32 and the last parity probe agreed within
    # 1e-4, where the two are the same numbers; recompute otherwise).
    old_logprobs: str = "recompute"
    # Drop truncated responses (finish reason "length") from the loss only; rewards, advantages
    # and the critic still see them.
    mask_truncated: bool = False
    # Off-policy correction for the rollout engine sampling from another policy than the
    # trainer's old one (numerics; async batches), by name (roll_ds/algorithms/corrections.py),
    # with rho_t = pi_old / pi_rollout per token: token_tis min(rho_t, tis_cap) | seq_tis
    # min(prod_t rho_t, tis_cap) per sequence | icepop rho_t, or 0 outside [correction_low,
    # correction_high] | geo_mask 0 for a sequence whose geometric mean of rho_t is outside
    # [correction_low, correction_high], else 1. Masked tokens stay in the loss's denominator.
    # null: token_tis where tis_cap is set (it is 2.0 under async_generation), else none.
    rollout_correction: str | None = None
    # token_tis / seq_tis weight cap; null: 2.0 where they are named (and under async_generation),
    # no correction where rollout_correction is null too.
    tis_cap: float | None = None
    # icepop / geo_mask: the kept region, 0 < low < 1 < high; null: icepop 0.5 / 5.0 (Ring-1T),
    # geo_mask 0.999 / 1.001.
    correction_low: float | None = None
    correction_high: float | None = None  # the upper bound of that region (> 1)
    # DAPO soft overlong punishment: a response within the last overlong_buffer_len tokens of
    # response_length loses up to overlong_penalty_factor of its score, linearly. 0: off.
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0  # the largest penalty, at response_length


@dataclass
class AsyncGenerationConfig:
    """Asynchronous rollouts: the rollout engines generate the batches of the next
    ``max_staleness`` steps while the trainer trains the current one, with the weights they had
    when each batch was submitted (so a batch is at most that many policy versions old)."""

    # 0: the synchronous loop (sync -> generate -> train, each waiting for the last).
    max_staleness: int = 0
    # batch: each step's batch is one generate call on the rollout actors; a sync waits for
    # the calls in flight and every batch is sampled by one policy version (bit-reproducible).
    # stream: batches stream through the engine's request queue (strategies/vllm/stream.py);
    # a sync pauses it between decode steps, requests in flight go on with the new weights
    # and each token records the version that sampled it. More overlap, not bit-reproducible
    # (where a sync lands depends on timing). Needs the vllm strategy and lora_sync=merged.
    mode: str = "batch"


@dataclass
class ColocationConfig:
    """Trainer and rollout engines on the same GPUs take turns holding them
    (roll_ds/pipeline/colocation/choreography.py): the engines start first and sleep while
    the trainers compute; the trainers are offloaded while the engines generate."""

    # auto: where roles share a GPU with the engines (nothing on CPU machines, nothing under
    # async_generation) | always: every model role, wherever placed | never: no offloading.
    offload: str = "auto"
    # vLLM sleep level while training: 1 keeps the weights in host memory, 2 drops them (the
    # next sync refills them; not with weight_sync.lora_sync=adapter).
    sleep_level: int = 1


@dataclass
class WeightSyncConfig:
    """How trained weights reach the rollout engines after every step."""

    # auto: cuda_ipc for colocated GPU workers, else collective where the ranks can form a
    # group, else object_store. Or name one: collective | object_store | cuda_ipc.
    transport: str = "auto"
    bucket_bytes: int = 256 * 2**20  # gathered per bucket (ZeRO-3 GatheredParameters)
    # A sync waits at most timeout_s plus the bytes it moves at min_gib_per_s (the weights at
    # the rollout dtype; under lora_sync=adapter the adapter's), then fails naming the stuck
    # role and ranks (a stuck trainer rank restarts the run: fault_tolerance).
    timeout_s: float = 600.0
    # The slowest throughput a sync may have before it counts as stuck, in GiB/s; low on
    # purpose (a 7B model in bf16, 14 GiB, adds 280 s): only a rank that stopped trips it.
    min_gib_per_s: float = 0.05
    # Under LoRA: merged (gather the full model, adapter merged in, reload it) | adapter (ship
    # only the adapter; vLLM keeps its base weights and serves base + adapter with enable_lora).
    lora_sync: str = "merged"
    # Parity check: after a sync, vLLM's and the trainer's log-probs on a fixed probe batch.
    parity_check: bool = True
    parity_probe_size: int = 4  # prompts in the parity probe
    # Stop the run when vLLM's log-probs differ from the trainer's by more than this max |delta|
    # after a sync; null: the default for the rollout dtype (weight_sync/parity.py).
    parity_max_abs_diff: float | None = None


@dataclass
class ExportConfig:
    """Hugging Face model directories of the trained policy, under ``<output_dir>/<exp_name>/hf/
    step_N/``: merged weights (safetensors), config, tokenizer and generation config, which plain
    transformers and vLLM load; under LoRA also ``adapter/``, a peft adapter over ``pretrain``.
    Any checkpoint converts afterwards with ``python -m roll_ds.export`` (roll_ds/export.py)."""

    at_end: bool = True  # export the final policy after the last step
    # Also export at every checkpoint (save_steps); unlike checkpoints these are never pruned.
    every_save: bool = False


@dataclass
class RayConfig:
    address: str | None = None  # null: $RAY_ADDRESS if set, else start a local Ray
    num_cpus: int | None = None  # local Ray only
    include_dashboard: bool = False  # start Ray's dashboard (local Ray only)
    namespace: str = "roll_ds"  # Ray namespace of the run's actors


@dataclass
class TrackingConfig:
    tensorboard: bool = True  # TensorBoard logs under <output_dir>/<exp_name>/
    jsonl: bool = True  # metrics.jsonl under <output_dir>/<exp_name>/
    wandb_project: str | None = None  # log to this Weights & Biases project; null: off
    # Write sampled responses to rollouts.jsonl every this many steps; 0: never.
    dump_rollouts_every: int = 10


@dataclass
class ValidationConfig:
    data_args: DataArgs = field(default_factory=DataArgs)  # the held-out rows
    # Sampling of the evaluation (greedy by default).
    generating_args: GeneratingArgs = field(default_factory=lambda: GeneratingArgs(temperature=0.0))
    max_prompts: int | None = None  # evaluate the first max_prompts rows; null: all
    # Besides the greedy answer, sample num_samples responses per prompt at sample_temperature
    # (with generating_args' top_p, top_k, max_new_tokens) and report eval/mean@k and
    # eval/pass@k, overall and per domain (roll_ds/pipeline/evaluation.py). 0: greedy only.
    num_samples: int = 0
    sample_temperature: float = 1.0  # temperature of the num_samples samples
    # The ks of eval/pass@k, each in 1..num_samples; empty: 1, 2, 4, ... and num_samples.
    pass_k: list[int] = field(default_factory=list)


@dataclass
class RLVRConfig:
    exp_name: str = "rlvr"  # the run's name: its outputs go to <output_dir>/<exp_name>/
    seed: int = 42  # seeds data order, sampling, environments, LoRA init
    output_dir: str = "./output"  # where runs write (relative: to the launch directory)
    # The policy: a local Hugging Face model directory or an embedded: name.
    pretrain: str = EMBEDDED_MODEL
    # Cluster shape: devices (GPUs, or CPU slots on CPU-only machines) per node, and node count.
    # Device ids in device_mapping are global: id // num_gpus_per_node is the node.
    num_gpus_per_node: int = 1
    num_nodes: int = 1  # nodes of the cluster
    # What device ids are: auto (GPUs when the Ray cluster advertises any, else CPU slots), cpu,
    # or cuda. Decided from the cluster, not the driver's own torch (roll_ds/platform.py).
    device: str = "auto"
    # CPUs reserved beside each GPU (its placement bundle; the offload optimizer's threads);
    # null: the GPU nodes' CPUs split over num_gpus_per_node, one CPU per node left over.
    cpus_per_gpu: float | None = None

    max_steps: int = 100  # training steps of the run
    save_steps: int = 0  # 0: no periodic checkpoints
    keep_last: int = 3  # complete checkpoints kept on disk (older ones are deleted); 0: all
    # An eval metric (e.g. eval/accuracy): the checkpoint with its best value is kept as
    # checkpoints/best (never pruned by keep_last); save_best_mode max or min. Null: off.
    save_best: str | None = None
    save_best_mode: str = "max"  # max | min: whether a higher save_best value is better
    logging_steps: int = 1  # log metrics every this many steps (and at the last)
    eval_steps: int = 0  # 0: no periodic evaluation
    # latest, or a checkpoints/step_NNNNNN (or best) path to continue from; null: start anew.
    resume_from_checkpoint: str | None = None

    rollout_batch_size: int = 8  # prompts per step
    num_return_sequences_in_group: int = 4  # samples per prompt: the GRPO group
    prompt_length: int = 128  # longest prompt in tokens (episodes: first observation)
    response_length: int = 64  # longest response (episodes: budget after the first turn)

    # Advantages, the policy loss, KL, filters and corrections.
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # Generation ahead of training (0 staleness: synchronous).
    async_generation: AsyncGenerationConfig = field(default_factory=AsyncGenerationConfig)
    colocation: ColocationConfig = field(default_factory=ColocationConfig)  # shared GPUs
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)  # trainer -> vLLM
    # Dead or stuck workers: stateless roles replaced in place, the run restarted from its
    # latest checkpoint after a trainer rank dies; every actor wait bounded.
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    export: ExportConfig = field(default_factory=ExportConfig)  # Hugging Face directories
    validation: ValidationConfig = field(default_factory=ValidationConfig)  # held-out eval
    ray: RayConfig = field(default_factory=RayConfig)  # the Ray cluster to connect to
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # metrics and dumps
    system_envs: dict[str, str] = field(default_factory=dict)  # env vars of every actor
    # Agentic RL (roll_ds/config/agentic.py): on when train_env_manager.tags is not empty
    custom_envs: dict[str, EnvSpecConfig] = field(default_factory=dict)
    # The environment episodes of a training step.
    train_env_manager: EnvManagerConfig = field(default_factory=EnvManagerConfig)
    # The held-out episodes of an evaluation.
    val_env_manager: EnvManagerConfig = field(default_factory=EnvManagerConfig)
    agentic: AgenticConfig = field(default_factory=AgenticConfig)  # the episode runner

    actor_train: WorkerConfig = field(default_factory=WorkerConfig)  # the policy's trainer
    actor_infer: WorkerConfig = field(default_factory=WorkerConfig)  # the rollout engines
    reference: WorkerConfig | None = None  # null under LoRA: the actor with its adapter disabled
    critic: WorkerConfig | None = None  # value model (deepspeed_train); adv_estimator gae only
    rewards: dict[str, RewardConfig] = field(default_factory=dict)  # reward roles by name
    # Values that replace what the config inherits instead of merging into it (Hydra merges
    # dicts): mirrors the config, e.g. `replace: {rewards: {...}}` drops the inherited reward
    # roles; every dict or list met on the way is replaced whole (roll_ds/config/replace.py).
    replace: dict[str, Any] = field(default_factory=dict)

    # DeepSpeed presets merged at the root by `defaults: - ../config/deepspeed_zero3@_here_`;
    # roles reference them as ${deepspeed_zero3}. Only the ones a YAML pulls in are set.
    deepspeed_zero: dict[str, Any] | None = None  # ZeRO stage 0 (plain data parallel)
    deepspeed_zero2: dict[str, Any] | None = None  # ZeRO-2: optimizer states and gradients
    deepspeed_zero2_cpuoffload: dict[str, Any] | None = None  # ZeRO-2, optimizer on CPU
    deepspeed_zero3: dict[str, Any] | None = None  # ZeRO-3: parameters partitioned too
    deepspeed_zero3_cpuoffload: dict[str, Any] | None = None  # ZeRO-3, offload to CPU
    deepspeed_zero3_nvme: dict[str, Any] | None = None  # ZeRO-3, offload to NVMe (ZeRO-Infinity)
