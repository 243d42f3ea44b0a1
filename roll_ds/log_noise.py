"""Silence third-party log lines that are known to be harmless in roll_ds's setup.

Each entry says why it can be ignored; anything not listed here still reaches the log. A run's
driver output interleaves every actor's lines with the progress bar, so a line repeated on every
step (or a traceback that is not an error) hides the ones that matter.

Python warnings, in every worker (``quiet_warnings``):

- torch 2.13 deprecates ``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor``
  (and the ``reduce_op`` alias); DeepSpeed 0.19 and vLLM 0.32 still call them, once per ZeRO-3
  gather, which printed ~240 FutureWarnings per short run.

vLLM log records (``quiet_vllm``, once vllm is imported):

- "Chat template warmup failed" with a traceback: roll_ds tokenizes itself and starts vLLM with
  ``skip_tokenizer_init``, so vLLM's chat-template warm-up has no tokenizer to render with.
- "RotaryEmbedding: Failed to load weights": the rotary cos/sin cache is a buffer, not a
  checkpoint tensor; vLLM's in-place reload keeps it and logs this on every weight sync.
- "CPU backend doesn't allow to use `torch.set_num_threads`": vLLM-CPU pins threads itself and
  turns later ``set_num_threads`` calls (its own warm-up's included) into this warning.
- "Using None for EOS token id because tokenizer is not initialized": roll_ds passes the stop
  token ids with every request.
- "This model does not officially support disabling chunked prefill": roll_ds turns chunked
  prefill off on CPU, where it crashes seeded sampling (``strategies/vllm/start.py``);
  ``tests/integration/test_vllm_long_prompts.py`` checks the outputs against an HF forward.

``VLLM_LOGGING_LEVEL`` defaults to WARNING in rollout workers (``vllm_log_env``), so vLLM's
per-sync INFO lines ("Reloading weights inplace...", "Successfully reset prefix cache") stay out
of the progress bar; set ``VLLM_LOGGING_LEVEL=INFO`` in the environment to see them again.
"""

from __future__ import annotations

import logging
import warnings

TORCH_DEPRECATIONS = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor|reduce_op)` "
    r"is deprecated"
)
# The vLLM module loggers that emit them -> the messages dropped there. Filters sit on these
# loggers because vLLM re-runs ``dictConfig`` on the ``vllm`` logger when an engine starts.
VLLM_HARMLESS = {
    "vllm.renderers.base": (
        "Chat template warmup failed",
        "Using None for EOS token id because tokenizer is not initialized",
    ),
    # any other layer's failure to load still shows
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed to load weights",
    ),
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use",),  # torch.set_num_threads
    "vllm.engine.arg_utils": ("does not officially support disabling chunked prefill",),
}
VLLM_DEFAULT_LEVEL = "WARNING"


def quiet_warnings() -> None:
    """Ignore the deprecation warnings above (idempotent: ``filterwarnings`` dedupes)."""
    warnings.filterwarnings("ignore", message=TORCH_DEPRECATIONS, category=FutureWarning)


def vllm_log_env() -> dict[str, str]:
    """Environment for a process about to import vllm (callers ``setdefault`` it)."""
    return {"VLLM_LOGGING_LEVEL": VLLM_DEFAULT_LEVEL}


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p in message for p in self.prefixes)


def quiet_vllm() -> None:
    """Drop the vLLM records above (idempotent; call before the engine starts)."""
    for name, messages in VLLM_HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(messages))
