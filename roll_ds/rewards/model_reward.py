"""Model-based reward terms of a reward role: a discriminative reward model (reward fn ``model``)
and, through ``roll_ds.rewards.judge``, a generative judge (reward fn ``judge``).

A reward role that names a model loads it with an inference strategy, chosen like every role's
(``strategy_args.strategy_name``), inside its reward worker; the role's ``reward_fns`` then use
it as one weighted term beside the rule functions, per domain::

    rewards:
      math:
        tag_included: [math]
        model_args: {model_name_or_path: embedded:tiny-rm}
        strategy_args: {strategy_name: hf_infer}
        head: sequence_classification
        score_transform: {sigmoid: true}
        reward_fns: [{name: math_rule, weight: 0.5}, {name: model, weight: 0.5}]

The loaded model reaches the reward functions as a *resource*: ``RewardScorer`` passes it to
the functions whose constructor takes it (``reward_model`` here, ``judge`` for the judge), so
the rule functions and the registry stay unaware of models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from roll_ds.config.schema import RewardConfig, ScoreTransform
from roll_ds.rewards.base import RewardFn, RewardOutput, RewardSample

if TYPE_CHECKING:
    from roll_ds.rewards.scorer import RewardScorer
    from roll_ds.strategy import StrategyContext

INPUT_TEMPLATES = ("raw", "chat")
MODEL_FN, JUDGE_FN = "model", "judge"

# prompts, responses -> raw reward-model scores
TextScorer = Callable[[Sequence[str], Sequence[str]], list[float]]


def transform_score(raw: float, transform: ScoreTransform) -> float:
    """``scale * (raw + shift)``, through a sigmoid when ``transform.sigmoid``."""
    value = transform.scale * (raw + transform.shift)
    if transform.sigmoid:
        # 1 / (1 + e^-x) without overflow for large |x|
        return (
            1.0 / (1.0 + math.exp(-value))
            if value >= 0
            else math.exp(value) / (1.0 + math.exp(value))
        )
    return value


def encode_pair(tokenizer: Any, prompt: str, response: str, template: str) -> list[int]:
    """Token ids the reward model reads for one sample: ``raw`` prompt + response text, or the
    tokenizer's chat template with the prompt as the user turn and the response as the
    assistant's."""
    if template == "chat":
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": response},
        ]
        return list(tokenizer.apply_chat_template(messages, tokenize=True))
    if template != "raw":
        raise ValueError(
            f"input_template: unknown {template!r}; valid: {', '.join(INPUT_TEMPLATES)}"
        )
    return list(tokenizer(prompt + response, add_special_tokens=False)["input_ids"])


class StrategyTextScorer:
    """Prompt/response texts -> raw scores of a ``SequenceScorer`` strategy (tokenized with the
    reward model's own tokenizer, which need not be the policy's)."""

    def __init__(self, strategy: Any, tokenizer: Any, input_template: str = "raw") -> None:
        self.strategy = strategy
        self.tokenizer = tokenizer
        self.input_template = input_template
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        from roll_ds.models.reward_model import left_pad

        sequences = [
            encode_pair(self.tokenizer, p, r, self.input_template)
            for p, r in zip(prompts, responses, strict=True)
        ]
        ids_BT, mask_BT = left_pad(sequences, self.pad_id)
        return self.strategy.score_sequences(ids_BT, mask_BT)["scores_B"].tolist()


class ModelReward(RewardFn):
    """Reward fn ``model``: the role's reward model scores prompt + response, batched; the
    role's ``score_transform`` maps the raw score. ``info["raw_score"]`` keeps the raw one.

    ``reward_model`` and ``score_transform`` are resources the reward worker provides (set
    ``rewards.<role>.head`` and ``model_args``); they are not written in ``reward_fns``.
    """

    name = MODEL_FN

    def __init__(
        self,
        reward_model: TextScorer | None = None,
        score_transform: ScoreTransform | None = None,
    ) -> None:
        super().__init__()
        if reward_model is None:
            raise ValueError(
                "reward fn 'model' needs the role's reward model: set the role's head "
                "(sequence_classification | value), model_args.model_name_or_path and "
                "strategy_args.strategy_name"
            )
        self.reward_model = reward_model
        self.transform = score_transform or ScoreTransform()

    def score_batch(self, samples: list[RewardSample]) -> RewardOutput:
        raw = self.reward_model([s.prompt for s in samples], [s.response for s in samples])
        scores = [transform_score(r, self.transform) for r in raw]
        infos = [{"timed_out": False, "error": None, "raw_score": r} for r in raw]
        return RewardOutput(scores, infos)


def build_role_scorer(cfg: RewardConfig, ctx: StrategyContext | None = None) -> RewardScorer:
    """The ``RewardScorer`` of a reward role; loads its reward model or judge (with the role's
    strategy, on this worker) when it names one."""
    from roll_ds.rewards.scorer import RewardScorer

    resources: dict[str, Any] = {}
    if cfg.head is not None or cfg.judge is not None:
        if ctx is None:
            raise ValueError("a reward role with a model needs the pipeline's StrategyContext")
        strategy, tokenizer = _load_strategy(cfg, ctx)
        if cfg.head is not None:
            resources["reward_model"] = StrategyTextScorer(strategy, tokenizer, cfg.input_template)
            resources["score_transform"] = cfg.score_transform
        else:
            from roll_ds.rewards.judge import StrategyJudge

            resources["judge"] = StrategyJudge(strategy, tokenizer, cfg.judge, cfg.input_template)
    return RewardScorer(cfg, resources=resources)


def _load_strategy(cfg: RewardConfig, ctx: StrategyContext) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    from roll_ds.models.loading import resolve_model_path
    from roll_ds.strategy import STRATEGIES

    cls = STRATEGIES.get(cfg.strategy_args.strategy_name)
    kwargs = {"head": cfg.head} if cfg.head is not None else {}
    strategy = cls.from_worker_config(cfg, ctx, **kwargs)
    strategy.initialize()
    path = resolve_model_path(cfg.model_args.model_name_or_path or ctx.pretrain)
    return strategy, AutoTokenizer.from_pretrained(path)


# --- validation ------------------------------------------------------------------------------


def _fn_names(reward_fns: Sequence[Any]) -> set[str]:
    names = set()
    for spec in reward_fns:
        if isinstance(spec, str):
            names.add(spec)
        elif hasattr(spec, "get") and isinstance(spec.get("name"), str):
            names.add(spec["name"])
    return names


def check_model_reward(name: str, role: RewardConfig) -> list[str]:
    """Problems of a reward role's model settings (``name``: ``rewards.<role>``): head and
    strategy combinations, a model without model_args, model terms without a model, and the
    judge's template and patterns (``roll_ds.rewards.judge.check_judge``)."""
    from roll_ds.config.strategies import can, names_with
    from roll_ds.models.reward_model import HEADS

    problems: list[str] = []
    strategy = role.strategy_args.strategy_name
    fns = _fn_names(list(role.reward_fns))
    has_model = role.head is not None or role.judge is not None
    if role.head is not None and role.judge is not None:
        problems.append(
            f"{name}: head and judge both set, but a role serves one model; put the judge in "
            "its own reward role, or remove one"
        )
    if role.head is not None:
        if role.head not in HEADS:
            problems.append(f"{name}.head: unknown head {role.head!r}; valid: {', '.join(HEADS)}")
        if not can(strategy, "scores_sequences"):
            problems.append(
                f"{name}.strategy_args.strategy_name: head {role.head!r} needs a backend that "
                f"scores sequences, one of {', '.join(names_with('scores_sequences'))} (got "
                f"{strategy!r})"
            )
        if MODEL_FN not in fns:
            problems.append(
                f"{name}.reward_fns: the role loads a reward model (head {role.head!r}) but no "
                f"term uses it; add {{name: {MODEL_FN}, weight: 1.0}}"
            )
    if role.judge is not None:
        from roll_ds.rewards.judge import check_judge

        if not can(strategy, "generates"):
            problems.append(
                f"{name}.strategy_args.strategy_name: a judge generates, so it needs one of "
                f"{', '.join(names_with('generates'))} (got {strategy!r})"
            )
        problems += check_judge(f"{name}.judge", role.judge)
        if JUDGE_FN not in fns:
            problems.append(
                f"{name}.reward_fns: the role loads a judge but no term uses it; add "
                f"{{name: {JUDGE_FN}, weight: 1.0}}"
            )
    if has_model and not role.model_args.model_name_or_path:
        what = "judge" if role.head is None else "reward model"
        problems.append(
            f"{name}.model_args.model_name_or_path: the role's {what} needs a model; set it "
            "to a local directory, embedded:tiny-rm (the embedded reward model) or ${pretrain}"
        )
    if not has_model and strategy is not None:
        problems.append(
            f"{name}.strategy_args.strategy_name: {strategy!r} is set but the role has neither a "
            "head (reward model) nor a judge; set one, or strategy_name: null for rule rewards"
        )
    for fn, needs in ((MODEL_FN, "head"), (JUDGE_FN, "judge")):
        if fn in fns and getattr(role, needs) is None:
            problems.append(
                f"{name}.reward_fns: term {fn!r} needs the role's {needs} (and model_args, "
                "strategy_args); set it or remove the term"
            )
    if role.input_template not in INPUT_TEMPLATES:
        problems.append(
            f"{name}.input_template: unknown {role.input_template!r}; valid: "
            + ", ".join(INPUT_TEMPLATES)
        )
    return problems
