"""math_rule with the real math-verify (no mocks): answers, failures, timeouts, worker crashes."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time

import pytest

from roll_ds.rewards.math_rule import MathRuleReward

# Python-level slow: sympy tries to evaluate the integral for about a minute.
SLOW_PY = r"The answer is \boxed{\int_0^1 e^{x^2} \sin(x^3) dx}"
# A huge big-integer power (2^(2^40) would need 128 GiB); CPython checks signals inside it.
HUGE_POWER = r"\boxed{2^{2^{40}}}"


@pytest.fixture(scope="module")
def math_rule():
    """The default configuration: worker process, 5 s timeout."""
    fn = MathRuleReward()
    fn.warmup()
    yield fn
    fn.close()


@pytest.fixture(scope="module")
def in_process():
    fn = MathRuleReward(timeout_backend="signal", timeout_s=5)
    yield fn
    fn.close()


CORRECT = [
    ("0.5", r"\frac{1}{2}"),
    (r"\frac{1}{2}", "0.5"),
    ("47", "47"),
    ("  47\n", "47"),
    (r"The answer is \boxed{12}", "12"),
    (r"First 3+4=7, then 7+5=12. So \boxed{12}. Check: 12-5=7.", "12"),
    (r"We get $\frac{3}{4}$, i.e. \boxed{\frac{3}{4}}", "0.75"),
    (r"2\pi", r"2\pi"),
    ("x+1", "1+x"),
    (r"\sqrt{2}", r"\sqrt{2}"),
    ("1,000", "1000"),
    ("-7", "-7"),
    ("3", ["4", "3"]),  # any of several golds
    ("3", 3),  # non-string gold
]

WRONG = [
    ("13", "12"),
    (r"The answer is \boxed{13}", "12"),
    ("2", r"2\pi"),  # a bare 2\pi gold is parsed as LaTeX, not as "the last number, 2"
    (r"\boxed{12} and \boxed{13}", "12"),
    ("", "12"),
    ("I don't know", "12"),
    ("hello world, lorem ipsum", "12"),
    ("%$#@!{{{}}", "12"),
    ("\\boxed{", "12"),
]


@pytest.mark.parametrize(("response", "gold"), CORRECT)
def test_correct_answers_score_one(math_rule, response, gold):
    out = math_rule([(response, gold, "prompt")])
    assert out.scores == [1.0], out.infos
    info = out.infos[0]
    assert info["correct"] is True
    assert info["timed_out"] is False
    assert info["error"] is None


@pytest.mark.parametrize(("response", "gold"), WRONG)
def test_wrong_or_garbage_answers_score_zero(math_rule, response, gold):
    out = math_rule([(response, gold, "prompt")])
    assert out.scores == [0.0]
    info = out.infos[0]
    assert info["correct"] is False
    assert info["timed_out"] is False
    assert info["error"] is None  # a wrong answer is not an error


def test_in_process_backend_agrees_with_worker_process(math_rule, in_process):
    samples = [(r, g, "") for r, g in CORRECT + WRONG]
    assert in_process(samples).scores == math_rule(samples).scores


def test_extracted_answer_is_reported(math_rule):
    info = math_rule([(r"so \boxed{12}.", "12")]).infos[0]
    assert info["extracted"] == "12"
    assert math_rule([("no answer here", "12")]).infos[0]["extracted"] is None


def test_configurable_scores():
    with MathRuleReward(correct_score=2.0, incorrect_score=-1.0, timeout_backend="none") as fn:
        assert fn([("47", "47"), ("48", "47")]).scores == [2.0, -1.0]


def test_unparsable_gold_is_counted_as_error(math_rule):
    out = math_rule([("3", ""), ("3", None)])
    assert out.scores == [0.0, 0.0]
    assert all(i["error"].startswith("gold_unparsed") for i in out.infos)


def test_soft_timeout_counts_and_worker_survives():
    with MathRuleReward(timeout_s=0.3, kill_grace_s=5.0) as fn:
        fn.warmup()
        pid = fn.pool.pids()[0]
        start = time.monotonic()
        out = fn([(SLOW_PY, "12"), ("47", "47"), (HUGE_POWER, "12"), ("5", "5")])
        elapsed = time.monotonic() - start
        assert out.scores == [0.0, 1.0, 0.0, 1.0]
        assert [i["timed_out"] for i in out.infos] == [True, False, True, False]
        assert out.infos[0]["correct"] is False
        assert elapsed < 3.0  # two 0.3 s timeouts, not a minute of sympy
        # The alarm inside the worker stopped both: no kill, same worker.
        assert fn.pool.num_killed == 0
        assert fn.pool.pids() == [pid]


def test_hung_worker_is_killed_and_queued_jobs_are_rescheduled():
    """A worker that stops answering (as if stuck in C code) is killed after timeout + grace:
    its current job is a timeout, the jobs queued behind it run on a fresh worker."""
    with MathRuleReward(timeout_s=0.5, kill_grace_s=0.5) as fn:
        fn.warmup()
        pid = fn.pool.pids()[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            # decimals: integer answers would not go to the worker at all
            out = fn([("4.5", "4.5"), ("1.5", "1.5"), ("2.5", "3.5"), (r"\boxed{4.5}", "4.5")])
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert out.infos[0]["timed_out"] is True
        assert out.scores == [0.0, 1.0, 0.0, 1.0]
        assert [i["timed_out"] for i in out.infos[1:]] == [False, False, False]
        assert fn.pool.num_killed == 1
        assert fn.pool.pids()[0] != pid
        assert fn([("4.5", "4.5")]).scores == [1.0]


def test_crashed_worker_fails_only_its_job():
    with MathRuleReward(timeout_s=10) as fn:
        fn.warmup()
        pid = fn.pool.pids()[0]
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        killer.start()
        out = fn([(SLOW_PY, "12"), ("4.5", "4.5"), ("0.5", r"\frac{1}{2}")])  # queued behind it
        killer.join()
        assert out.scores == [0.0, 1.0, 1.0]
        assert out.infos[0]["error"].startswith("worker_crashed")
        assert out.infos[0]["timed_out"] is False
        assert out.infos[1]["error"] is None


def test_signal_backend_timeout_and_handler_restored():
    seen = []
    previous = signal.signal(signal.SIGALRM, lambda *a: seen.append(a))
    try:
        with MathRuleReward(timeout_backend="signal", timeout_s=0.3) as fn:
            out = fn([(SLOW_PY, "12"), ("47", "47")])
            assert out.scores == [0.0, 1.0]
            assert out.infos[0]["timed_out"] is True
        assert signal.getsignal(signal.SIGALRM) is not None
        assert signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, signal.SIG_IGN)
        signal.raise_signal(signal.SIGALRM)  # our handler is back in place
        assert len(seen) == 1
    finally:
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("backend", ["process", "signal"])
def test_works_outside_the_main_thread(backend):
    """Ray threaded / async actors call from other threads, where signals cannot be used:
    the signal backend falls back to worker processes and timeouts still work."""
    results = {}

    def run():
        with MathRuleReward(timeout_backend=backend, timeout_s=0.3, kill_grace_s=0.5) as fn:
            results["out"] = fn([("47", "47"), (SLOW_PY, "12")])

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    out = results["out"]
    assert out.scores == [1.0, 0.0]
    assert out.infos[1]["timed_out"] is True


def test_throughput_on_1000_simple_answers(math_rule, capsys):
    rng = random.Random(0)
    samples = []
    for i in range(1000):  # 1000 distinct (answer, gold) pairs: none is remembered
        a, b = rng.randint(1, 99), 1000 * (i + 1)
        answer = a + b if i % 4 else a + b + 1
        # decimals, so that every pair goes through math-verify in the worker (integers do not)
        samples.append((f"{answer}.5", f"{a + b}.5", f"{a}.5+{b}="))
    start = time.perf_counter()
    out = math_rule(samples)
    elapsed = time.perf_counter() - start
    assert sum(out.scores) == 750
    assert not any(i["timed_out"] or i["error"] for i in out.infos)
    rate = len(samples) / elapsed
    with capsys.disabled():
        print(f"\nmath_rule throughput: {rate:.0f} verifications/s (1000 answers, 1 worker)")
    assert rate > 20  # loose: CI machines are slow and shared


def _counting(fn: MathRuleReward, monkeypatch) -> list[int]:
    """How many jobs each of ``fn``'s verify rounds was given."""
    calls: list[int] = []
    verify = fn._verify
    monkeypatch.setattr(fn, "_verify", lambda jobs: calls.append(len(jobs)) or verify(jobs))
    return calls


def test_repeated_answers_are_verified_once_with_the_same_verdicts(monkeypatch):
    batch = [
        ("12", "12"),
        ("12", "12"),
        ("13", "12"),
        (r"\frac{1}{2}", "0.5"),
        ("12", ["11", "12"]),  # another gold: another verdict
        ("no answer", "12"),
    ]
    with MathRuleReward(timeout_backend="signal") as fn, MathRuleReward(cache_size=0) as plain:
        calls = _counting(fn, monkeypatch)
        first, again, want = fn(batch), fn(batch), plain(batch)
    assert first.scores == again.scores == want.scores == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert first.infos == again.infos == want.infos
    assert calls == [5, 0]  # five distinct pairs, then none


def test_timeouts_are_not_remembered_and_the_cache_is_bounded(monkeypatch):
    with MathRuleReward(timeout_backend="signal", timeout_s=0.3, cache_size=1) as fn:
        calls = _counting(fn, monkeypatch)
        assert fn([(SLOW_PY, "12")]).infos[0]["timed_out"]
        assert fn([(SLOW_PY, "12")]).infos[0]["timed_out"]  # verified again
        fn([("1", "1")])
        fn([("2", "2")])  # pushes ("1", "1") out
        fn([("1", "1"), ("2", "2")])
    assert calls == [1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="cache_size"):
        MathRuleReward(cache_size=-1)


INTEGER_PAIRS = [
    ("47", ["47"]),
    ("  47\n", ["47"]),
    ("46", ["47"]),
    ("-7", ["-7"]),
    ("-7", ["7"]),
    ("0", ["0"]),
    ("-0", ["0"]),
    ("3", ["4", "3"]),
    ("3", ["4", "5"]),
    (r"The answer is \boxed{12}", ["12"]),
    (r"First 3+4=7, then \boxed{ 12 }.", [" 12 "]),
    (r"\boxed{-12}", ["12"]),
    ("123456789012345678901234567890", ["123456789012345678901234567890"]),
]
NOT_INTEGER_PAIRS = [
    ("+5", ["5"]),  # math-verify extracts nothing from "+5"
    ("007", ["7"]),  # ... and "7" from "007"
    ("12", ["12.0"]),
    ("1,000", ["1000"]),
    ("1234567890123456789012345678901", ["1"]),  # 31 digits
    (r"\boxed{12} and \boxed{13}", ["12"]),
    (r"\boxed{12", ["12"]),
    ("x", ["1"]),
    ("5", []),
]


@pytest.mark.parametrize(("response", "golds"), INTEGER_PAIRS)
def test_integer_answers_get_math_verifys_verdict_without_it(response, golds):
    from roll_ds.rewards.verify import VerifyOptions, integer_verdict, verify_with_alarm

    want = verify_with_alarm(response, golds, VerifyOptions(), None)
    assert integer_verdict(response, golds) == want


@pytest.mark.parametrize(("response", "golds"), NOT_INTEGER_PAIRS)
def test_other_answers_are_left_to_math_verify(response, golds):
    from roll_ds.rewards.verify import integer_verdict

    assert integer_verdict(response, golds) is None


def test_a_batch_of_integer_answers_needs_no_worker():
    with MathRuleReward() as fn:  # the process backend, no worker started yet
        out = fn([("12", "12"), (r"so \boxed{13}", "12"), ("-4", ["4", "-4"])])
        assert fn._pool is None
        assert out.scores == [1.0, 0.0, 1.0]
        assert [i["extracted"] for i in out.infos] == ["12", "13", "-4"]
        assert fn([("0.5", r"\frac{1}{2}")]).scores == [1.0]  # the rest still goes to math-verify
        assert fn._pool is not None
