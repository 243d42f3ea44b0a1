"""Generative judge (reward fn ``judge``): a causal LM, served by the role's vllm or hf_infer
strategy, is prompted from the role's ``judge.template`` with the question, the response and
optionally the reference answer; its verdict text is parsed into a score by ``judge.patterns``.

A judge never takes the run down: a verdict no pattern matches scores ``unparsed_score`` with
``error: "judge: unparsed verdict ..."`` (counted in ``rollout/errors`` / ``eval/errors``), and a
batch the engine does not finish within ``timeout_s`` scores ``unparsed_score`` with
``timed_out`` set (counted in ``rollout/timeouts``); the scorer's batch metrics count unparsed
verdicts as ``judge_unparsed`` and timeouts as ``num_timeouts``.
"""

from __future__ import annotations

import concurrent.futures
import re
import string
from collections.abc import Sequence
from typing import Any

from roll_ds.config.schema import JudgeConfig, JudgePattern
from roll_ds.rewards.base import RewardFn, RewardOutput, RewardSample, ground_truth_list

PLACEHOLDERS = ("question", "response", "reference")
REQUIRED_PLACEHOLDERS = ("question", "response")
UNPARSED = "judge: unparsed verdict"
DEFAULT_MAX_NEW_TOKENS = 32


def template_fields(template: str) -> list[str]:
    """The ``{name}`` fields of a ``str.format`` template (raises ValueError when malformed)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def fill_template(template: str, question: str, response: str, reference: Any) -> str:
    refs = ground_truth_list(reference)
    return template.format(question=question, response=response, reference=refs[0] if refs else "")


def parse_verdict(text: str, patterns: Sequence[JudgePattern]) -> float | None:
    """The score of the first pattern that matches ``text``: its ``score``, or (``score`` None)
    its first group read as a number; None when nothing matches or the group is no number."""
    for pattern in patterns:
        match = re.search(pattern.regex, text)
        if match is None:
            continue
        if pattern.score is not None:
            return float(pattern.score)
        try:
            return float(match.group(1))
        except (IndexError, TypeError, ValueError):
            return None
    return None


def check_judge(field: str, judge: JudgeConfig) -> list[str]:
    """Problems of a judge config: template placeholders, regexes, numbers to read."""
    problems = []
    try:
        names = template_fields(judge.template)
    except ValueError as exc:
        return [
            f"{field}.template: not a valid template ({exc}); write literal braces as {{{{ }}}}"
        ]
    unknown = sorted(set(names) - set(PLACEHOLDERS))
    if unknown:
        problems.append(
            f"{field}.template: unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}"
            f"; valid: {', '.join('{' + p + '}' for p in PLACEHOLDERS)} (literal braces: {{{{ }}}})"
        )
    missing = [p for p in REQUIRED_PLACEHOLDERS if p not in names]
    if missing:
        problems.append(
            f"{field}.template: needs {', '.join('{' + p + '}' for p in missing)}, where the "
            "question and the response to judge go"
        )
    if not judge.patterns:
        problems.append(f"{field}.patterns: empty; give at least one {{regex, score}} rule")
    for i, pattern in enumerate(judge.patterns):
        try:
            compiled = re.compile(pattern.regex)
        except re.error as exc:
            problems.append(f"{field}.patterns[{i}].regex: not a valid regex ({exc})")
            continue
        if pattern.score is None and compiled.groups < 1:
            problems.append(
                f"{field}.patterns[{i}]: score is null, so the score is read from the regex's "
                "first group, but the regex has none; add a group such as ([0-9.]+) or set score"
            )
    if not judge.timeout_s > 0:
        problems.append(f"{field}.timeout_s: must be > 0, got {judge.timeout_s}")
    return problems


class StrategyJudge:
    """Prompts -> verdict texts with a generating strategy (greedy unless the role's
    generating_args say otherwise); a batch past ``timeout_s`` returns None."""

    def __init__(self, strategy: Any, tokenizer: Any, cfg: JudgeConfig, input_template: str):
        self.strategy = strategy
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.input_template = input_template
        # One thread: a batch that timed out still finishes before the next one starts (the
        # engine is not reentrant), and the caller never waits past timeout_s.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="judge")

    def _encode(self, text: str) -> list[int]:
        if self.input_template == "chat":
            messages = [{"role": "user", "content": text}]
            return list(
                self.tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True
                )
            )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generate(self, prompts: list[list[int]]) -> list[str]:
        gen = getattr(self.strategy, "generating_args", None)
        max_new = getattr(gen, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS
        eos = self.tokenizer.eos_token_id
        out = self.strategy.generate(
            prompts,
            n=1,
            max_new_tokens=max_new,
            stop_token_ids=[eos] if eos is not None else None,
        )
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in out["response_ids"]]

    def __call__(self, texts: Sequence[str]) -> list[str] | None:
        prompts = [self._encode(t) for t in texts]
        future = self._pool.submit(self._generate, prompts)
        try:
            return future.result(timeout=self.cfg.timeout_s)
        except concurrent.futures.TimeoutError:
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class JudgeReward(RewardFn):
    """Reward fn ``judge``: the role's judge verdict per sample, parsed into a score.

    ``judge`` is a resource the reward worker provides (set ``rewards.<role>.judge``,
    ``model_args`` and ``strategy_args``); it is not written in ``reward_fns``. Info:
    ``verdict`` (the generated text), ``judge_unparsed``.
    """

    name = "judge"

    def __init__(self, judge: StrategyJudge | None = None) -> None:
        super().__init__()
        if judge is None:
            raise ValueError(
                "reward fn 'judge' needs the role's judge: set the role's judge (template, "
                "patterns), model_args.model_name_or_path and strategy_args.strategy_name"
            )
        self.judge = judge
        self.cfg = judge.cfg
        self.incorrect_score = float(self.cfg.unparsed_score)

    def score_batch(self, samples: list[RewardSample]) -> RewardOutput:
        texts = [
            fill_template(self.cfg.template, s.prompt, s.response, s.ground_truth) for s in samples
        ]
        verdicts = self.judge(texts)
        if verdicts is None:
            failed = [
                self.failure(timed_out=True, judge_unparsed=False, verdict=None) for _ in samples
            ]
            return RewardOutput([s for s, _ in failed], [i for _, i in failed])
        scores, infos = [], []
        for verdict in verdicts:
            score = parse_verdict(verdict, self.cfg.patterns)
            unparsed = score is None
            scores.append(self.incorrect_score if unparsed else score)
            error = f"{UNPARSED} {verdict[:60]!r}" if unparsed else None
            infos.append(
                {"timed_out": False, "error": error, "verdict": verdict, "judge_unparsed": unparsed}
            )
        return RewardOutput(scores, infos)

    def close(self) -> None:
        self.judge.close()
