r"""``code``: the response is a Python program, scored by running it against test cases.

The program is the last ```` ```python ```` (or ```` ```py ````) fenced block of the response,
else its last ```` ``` ```` block, else the whole response. Each test runs in a fresh
:class:`~roll_ds.sandbox.run.Sandbox` (its own namespaces and minimal root, an unprivileged
user, rlimits, a cgroup where the host offers one, no network); see that module for what is and
is not isolated.

Ground truth (a JSON string, or the already parsed value): a list of tests, or
``{"tests": [...]}``; a test is either

* ``{"input": "3 4\n", "output": "7\n"}``: the program reads ``input`` on stdin and passes if
  its stdout matches ``output`` (``compare: lines``, the default, ignores trailing whitespace on
  each line and trailing blank lines; ``exact`` compares bytes), or
* ``{"assert": "assert add(3, 4) == 7"}``: the statement is appended to the program, which runs
  with empty stdin and passes if it exits with status 0.

Score: ``scoring: fraction`` (default) gives ``incorrect + (correct - incorrect) * passed / n``;
``all_or_nothing`` gives ``correct_score`` only when every test passes. A run that hits a
resource limit (timeout, memory, output, process count) or does not compile ends the sample:
its remaining tests count as failed without running (an infinite loop would otherwise cost
``timeout_s`` per test); under ``all_or_nothing`` the first failure ends it.

Info per sample: ``correct`` (all tests passed), ``passed`` / ``num_tests``, ``error_category``
(the first failing test's category, ``passed`` if none failed, ``no_code`` for an empty
program, ``bad_tests`` for an unreadable ground truth), ``categories`` ({category: number of
tests}), ``timed_out`` (a test hit the timeout) and ``error`` (set only when the reward itself
failed: ``bad_tests`` or ``sandbox_error``; a program's own failures are categories, not errors).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

from roll_ds.rewards.base import GroundTruth, RewardFn, RewardOutput, RewardSample
from roll_ds.sandbox import NETWORK_ISOLATION, Sandbox, SandboxLimits, SandboxResult
from roll_ds.sandbox.result import last_exception

logger = logging.getLogger(__name__)

SCORING = ("fraction", "all_or_nothing")
COMPARE = ("lines", "exact")
#: categories after which the remaining tests of a sample are not run
_ENDS_SAMPLE = ("timeout", "memory", "output_limit", "process_limit", "syntax_error")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_LIMIT_FIELDS = tuple(f.name for f in fields(SandboxLimits))


@dataclass(frozen=True)
class CodeTest:
    """One test: stdin -> expected stdout, or an assert statement run after the program."""

    stdin: str = ""
    expected: str | None = None
    assertion: str | None = None


def parse_tests(ground_truth: GroundTruth) -> list[CodeTest]:
    """Tests of a ground truth (see the module doc); raises ValueError naming what is wrong."""
    try:
        value = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    except json.JSONDecodeError as e:
        raise ValueError(f"ground truth is not JSON ({e})") from None
    if isinstance(value, Mapping):
        value = value.get("tests")
    if not isinstance(value, list) or not value:
        raise ValueError('expected a non-empty list of tests or {"tests": [...]}')
    tests = []
    for i, t in enumerate(value):
        if isinstance(t, Mapping) and isinstance(t.get("assert"), str):
            tests.append(CodeTest(assertion=t["assert"]))
        elif isinstance(t, Mapping) and isinstance(t.get("output"), str):
            stdin = t.get("input", "")
            if not isinstance(stdin, str):
                raise ValueError(f"test {i}: 'input' must be a string")
            tests.append(CodeTest(stdin=stdin, expected=t["output"]))
        else:
            raise ValueError(f'test {i}: expected {{"input", "output"}} or {{"assert"}}, got {t!r}')
    return tests


def extract_program(response: str) -> str:
    """The last python fence, else the last fence of any language, else the whole response."""
    blocks = _FENCE.findall(response or "")
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return response or ""


def outputs_match(actual: str, expected: str, compare: str = "lines") -> bool:
    if compare == "exact":
        return actual == expected

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


def categorize_test(test: CodeTest, result: SandboxResult, compare: str) -> str:
    """``passed``, ``wrong_answer``, or the sandbox category of the failed run."""
    if result.category == "ok":
        if test.assertion is not None or outputs_match(result.stdout, test.expected or "", compare):
            return "passed"
        return "wrong_answer"
    if test.assertion is not None and last_exception(result.stderr) == "AssertionError":
        return "wrong_answer"
    return result.category


def code_option_problems(params: Mapping[str, Any]) -> list[str]:
    """Problems of a ``code`` reward spec's parameters, each naming the field and the fix."""
    problems = []
    for name, valid in (
        ("scoring", SCORING),
        ("compare", COMPARE),
        ("network_isolation", NETWORK_ISOLATION),
    ):
        if name in params and params[name] not in valid:
            problems.append(f"{name}: {params[name]!r}; valid: {', '.join(valid)}")
    workers = params.get("num_workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        problems.append(f"num_workers: {workers!r}; use an integer >= 1 (CPU cores to use)")
    limits = {k: v for k, v in params.items() if k in _LIMIT_FIELDS}
    problems += SandboxLimits(**limits).problems()
    return problems


def category_counts(infos: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """``{category: tests}`` summed over samples' infos (for batch metrics)."""
    total: Counter[str] = Counter()
    for info in infos:
        total.update(info.get("categories") or {})
    return dict(total)


class CodeReward(RewardFn):
    """Fraction (or all) of the ground truth's tests the response's program passes."""

    name = "code"
    failure_info = {"correct": False, "passed": 0, "num_tests": 0}  # noqa: RUF012

    def __init__(
        self,
        scoring: str = "fraction",
        compare: str = "lines",
        num_workers: int = 2,
        network_isolation: str = "required",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        file_size_mb: int = 4,
        max_processes: int = 8,
        max_open_files: int = 64,
        max_output_bytes: int = 1 << 20,
        workdir_mb: int = 16,
        sandbox_uid: int = 65534,
        sandbox_gid: int = 65534,
        correct_score: float = 1.0,
        incorrect_score: float = 0.0,
    ) -> None:
        super().__init__(correct_score, incorrect_score)
        params = dict(
            scoring=scoring,
            compare=compare,
            num_workers=num_workers,
            network_isolation=network_isolation,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            file_size_mb=file_size_mb,
            max_processes=max_processes,
            max_open_files=max_open_files,
            max_output_bytes=max_output_bytes,
            workdir_mb=workdir_mb,
        )
        if problems := code_option_problems(params):
            raise ValueError("code reward: " + "; ".join(problems))
        self.scoring, self.compare, self.num_workers = scoring, compare, num_workers
        limits = SandboxLimits(**{k: params[k] for k in _LIMIT_FIELDS})
        self.sandbox = Sandbox(limits, network_isolation, sandbox_uid, sandbox_gid)
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def param_problems(cls, params: Mapping[str, Any]) -> list[str]:
        """Config validation hook (see ``registry.validate_reward_specs``)."""
        return code_option_problems(params)

    def warmup(self) -> None:
        """Probe the kernel once: raises SandboxUnavailable under ``network_isolation:
        required`` where the namespaces cannot be created. Says how much memory this worker's
        concurrent runs may take at most (rlimits only: per process)."""
        self.sandbox.probe()
        lim = self.sandbox.limits
        per_run = lim.memory_mb * (1 if self.sandbox.cgroup_parent else lim.max_processes)
        worst = self.num_workers * per_run
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
        (logger.warning if worst > host // 2 else logger.info)(
            "code reward: its runs may take up to %d MB together (num_workers %d x %s); "
            "this host has %d MB",
            worst,
            self.num_workers,
            f"memory_mb {lim.memory_mb}, the run's cgroup"
            if self.sandbox.cgroup_parent
            else f"max_processes {lim.max_processes} x memory_mb {lim.memory_mb}, rlimits only",
            host,
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def score_batch(self, samples: list[RewardSample]) -> RewardOutput:
        self.sandbox.probe()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="code-reward")
        results = list(self._pool.map(self._score_sample, samples))
        return RewardOutput([s for s, _ in results], [i for _, i in results])

    def _score_sample(self, sample: RewardSample) -> tuple[float, dict]:
        try:
            tests = parse_tests(sample.ground_truth)
        except (ValueError, TypeError) as e:
            return self.failure(e, error_category="bad_tests", categories={"bad_tests": 1})
        program = extract_program("" if sample.response is None else str(sample.response))
        categories, details = self._run_tests(program, tests)
        passed = categories.count("passed")
        info = {
            "correct": passed == len(tests),
            "passed": passed,
            "num_tests": len(tests),
            "error_category": next((c for c in categories if c != "passed"), "passed"),
            "categories": dict(Counter(categories)),
            "timed_out": "timeout" in categories,
            "error": f"sandbox_error: {details[-1]}" if details else None,
        }
        if self.scoring == "all_or_nothing":
            score = self.correct_score if info["correct"] else self.incorrect_score
        else:
            frac = passed / len(tests)
            score = self.incorrect_score + (self.correct_score - self.incorrect_score) * frac
        return score, info

    def _run_tests(self, program: str, tests: list[CodeTest]) -> tuple[list[str], list[str]]:
        """Category of each test run (in order, stopping early as the module doc says), and
        the details of sandbox errors."""
        if not program.strip():
            return ["no_code"], []
        categories, details = [], []
        for test in tests:
            source = program if test.assertion is None else f"{program}\n\n{test.assertion}\n"
            result = self.sandbox.run(source, test.stdin)
            if result.category == "sandbox_error":
                details.append(result.detail)
            category = categorize_test(test, result, self.compare)
            categories.append(category)
            if category in _ENDS_SAMPLE or (
                category != "passed" and self.scoring == "all_or_nothing"
            ):
                break
        return categories, details
