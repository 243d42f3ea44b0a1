"""roll_ds: RL post-training for LLMs on Ray (DeepSpeed ZeRO training, vLLM rollouts)."""

__version__ = "0.1.0"
