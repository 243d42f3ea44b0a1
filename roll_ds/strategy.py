"""The contracts every backend implements, and what it exposes to weight sync.

A role picks its backend with ``strategy_args.strategy_name``. Backends live in the top-level
``strategies/`` package, which builds on this core; the core finds them only by name through
``STRATEGY_SPECS`` (``"module:attr"`` strings, in ``roll_ds/config/strategies.py`` because
validation reads them; re-exported here), never by import. A backend's own config checks sit in a
light module of its own, named by its spec. Importing this module must stay cheap.

Adding a backend: a module under ``strategies/`` with a class implementing ``TrainStrategy`` or
``GenerateStrategy`` (and a ``from_worker_config`` classmethod), plus one ``STRATEGY_SPECS`` line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

# The registry lives in the config layer (validation reads it); re-exported here.
from roll_ds.config.strategies import STRATEGIES as STRATEGIES
from roll_ds.config.strategies import STRATEGY_SPECS as STRATEGY_SPECS
from roll_ds.config.strategies import StrategySpec as StrategySpec
from roll_ds.config.strategies import load_hook as load_hook

if TYPE_CHECKING:
    import torch


# A bucket of a weight sync: HF-named tensors, in one size-bounded group.
Bucket = list[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join (picklable, sent by the driver)."""

    host: str  # train rank 0's address; it hosts the TCPStore
    port: int
    world_size: int  # 1 + number of receivers (one per vLLM worker)
    backend: str  # gloo | nccl
    timeout_s: float
    prefix: str  # store namespace, new for every connect


NamedTensors = Iterator[tuple[str, "torch.Tensor"]]
# One member's place in a weight-sync group: the group and its rank there. Under cuda_ipc the
# workers of one tensor-parallel engine sit in different groups (one per GPU, each rooted at the
# train rank on that GPU), so seats are per member.
Seat = tuple["GroupSpec", int]


# ---------------------------------------------------------------------------------------------
# what rollout and training strategies expose to weight sync (roll_ds/weight_sync/endpoint.py)


@runtime_checkable
class WeightSource(Protocol):
    """A training strategy whose weights a sync sends (actor_train)."""

    def named_weights_for_sync(self, bucket_bytes: int) -> Iterator[Bucket]:
        """Full (gathered, LoRA-merged) weights under HF names, in size-bounded buckets."""

    def adapter_buckets_for_sync(self, bucket_bytes: int) -> Iterator[Bucket]:
        """The LoRA adapter alone, under peft's names (``weight_sync.lora_sync: adapter``)."""

    def adapter_config(self) -> dict[str, Any]:
        """The policy's LoRA config as ``adapter_config.json`` content."""

    def sync_numels(self, adapter_only: bool) -> dict[torch.dtype, int]:
        """Elements by dtype of what one sync sends (the buckets of the two methods above),
        counted without gathering: a sync's bound scales with its bytes."""


@runtime_checkable
class WeightReceiver(Protocol):
    """A rollout strategy a sync can replace the served weights of."""

    def load_weights(self, named_tensors: NamedTensors) -> dict[str, Any] | None:
        """Replace the served weights with the *full* model from one iterator of HF-named
        tensors (the buckets of a sync chained); returns load stats or None."""


@runtime_checkable
class AdapterReceiver(WeightReceiver, Protocol):
    """A rollout strategy that can serve base weights + a synced LoRA adapter."""

    def enable_adapter_sync(self, config: Mapping[str, Any]) -> None:
        """From now on ``load_weights`` (and group receives) carry the adapter described by
        ``config`` (peft's ``adapter_config.json``) instead of full weights."""


class GroupMembers(Protocol):
    """The group side of a receiving strategy: the weight-sync group members it brings, joining,
    receiving one sync from the group into the served weights, leaving."""

    def transfer_group_devices(self) -> list[str | None]:
        """One entry per member it brings to a weight-sync group: the UUID of the GPU that
        member receives on (None on CPU). ``cuda_ipc`` pairs each member with the train rank on
        the same GPU by it."""

    def join_transfer_group(self, plane: str, seats: Sequence[Seat]) -> list[int]:
        """Member ``i`` joins ``seats[i]`` (leaving any previous group); returns the ranks
        taken."""

    def receive_from_group(self, plane: str) -> dict[str, Any]:
        """Every member receives one sync from the group into one reload; afterwards the new
        weights are served. Returns load stats."""

    def leave_transfer_group(self) -> None:
        """Every member leaves its group (a no-op where none was joined)."""


@runtime_checkable
class EngineWorkersReceiver(WeightReceiver, GroupMembers, Protocol):
    """An engine whose own worker processes are the group members (one per engine worker):
    group transports stream into them, not through the rollout worker's process."""

    receives_in_engine_workers: bool  # True


def receives_in_engine_workers(strategy: Any) -> bool:
    """Whether ``strategy`` declared that its engine's workers join the group themselves."""
    return bool(getattr(strategy, "receives_in_engine_workers", False))


@dataclass(frozen=True, kw_only=True)
class StrategyContext:
    """Pipeline-level facts every backend may need besides its role's config."""

    pretrain: str  # resolved model directory (the role's model_args may override it)
    seed: int
    max_steps: int  # optimizer steps an LR schedule spans (per training role, all passes)
    response_length: int  # default max_new_tokens for generation
    stop_token_ids: tuple[int, ...] = ()
    # Rollouts are sampled from softmax(logits / T): the log-probs the trainer and the reference
    # compute (and train on) are of that same distribution. 1.0 for greedy or untempered rollouts.
    logprob_temperature: float = 1.0
    # weight_sync.lora_sync=adapter: the policy's LoRA rank (rollout engines start with LoRA
    # support and serve base + the synced adapter); None: syncs carry merged full weights.
    adapter_sync_rank: int | None = None
    # The rollout role's longest sequence (prompt_length + the longest generation): its engine's
    # context length (vllm: max_model_len) where the role's strategy_config sets none. None for
    # the other roles: the engine's own default (the model's max_position_embeddings).
    max_sequence_length: int | None = None
    # Where the role's DeepSpeed config puts ZeRO-Infinity's swap files when its nvme_path is
    # "auto" (roll_ds.config.deepspeed.role_nvme_dir: the role's directory under the run's
    # output); None outside a pipeline run: such a config is then an error naming the key.
    nvme_dir: str | None = None
    # The trainers' process-group timeout (fault_tolerance.process_group_timeout_s); None
    # outside a pipeline run: DeepSpeed's own default.
    process_group_timeout_s: float | None = None


@runtime_checkable
class InferenceStrategy(Protocol):
    """Loads a model and scores batches; rollout backends also generate."""

    def initialize(self) -> None:
        """Load the model (and build process groups / engines) on this worker."""

    def compute_logprobs(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        *,
        with_entropy: bool,
        temperature: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probs of ``input_ids[:, 1:]`` (``logprobs_BT``), optionally ``entropy_BT``, under
        ``softmax(logits / temperature)``; None: the context's ``logprob_temperature``."""

    def offload_states(self) -> None:
        """Free accelerator memory (colocation); a no-op on CPU."""

    def reload_states(self) -> None:
        """Undo ``offload_states``."""


@runtime_checkable
class GenerateStrategy(InferenceStrategy, WeightReceiver, Protocol):
    """A rollout backend. Weight syncs replace what it serves: ``load_weights`` (from
    ``WeightReceiver``) at least; ``roll_ds.weight_sync.endpoint`` lists what else a backend
    can declare (``enable_adapter_sync``, ``receives_in_engine_workers``)."""

    def generate(self, prompts: list[list[int]], **sampling: Any) -> dict[str, Any]:
        """Sample responses: token ids and the sampled tokens' log-probs per sample."""


@runtime_checkable
class SequenceScorer(Protocol):
    """A reward-model backend (``hf_infer`` / ``deepspeed_infer`` built with a ``head``)."""

    def initialize(self) -> None: ...

    def score_sequences(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``scores_B``: one scalar per left-padded sequence, read at its last token."""


LossFn = Callable[..., tuple["torch.Tensor", dict[str, float]]]


@runtime_checkable
class TrainStrategy(InferenceStrategy, WeightSource, Protocol):
    """A training backend; a policy's weights reach the rollout engines through the
    ``WeightSource`` methods (``named_weights_for_sync``, ``adapter_buckets_for_sync``)."""

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` (micro-batched, accumulated); returns metrics."""

    def save_checkpoint(self, path: str, tag: str) -> None: ...

    def load_checkpoint(self, path: str, tag: str) -> None: ...
