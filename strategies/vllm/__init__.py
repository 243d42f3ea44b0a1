"""The vLLM backend, one package like ``strategies/deepspeed/``:

strategy.py       ``VllmStrategy``: the engine owned by a rollout worker (start, offload, close)
generation.py     its requests: generate, streaming generation, prompt log-probs
weight_sync.py    its weight sync: receiving weights, the reload, KV reset, adapter syncs
stream.py         the request stream that streaming generation steps in a thread
requests.py       requests and outputs as plain data (unit-tested with fakes, no vLLM import)
start.py          a bounded, version-checked engine start; CPU-only start-up choices
worker_ext.py     ``RollDsWorkerExtension``, loaded by every vLLM worker process
config_checks.py  the backend's own config checks (``STRATEGY_SPECS["vllm"]``); no vLLM import
"""

from strategies.vllm.strategy import VllmStrategy

__all__ = ["VllmStrategy"]
