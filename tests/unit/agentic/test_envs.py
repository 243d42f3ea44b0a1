"""The shipped environments: deterministic resets, step semantics, format errors, and a
calculator tool that evaluates arithmetic and nothing else."""

from __future__ import annotations

import pytest

from roll_ds.agentic.envs.calculator import CALCULATOR_TOOL, CalculatorEnv, safe_eval
from roll_ds.agentic.envs.guess_number import GuessNumberEnv
from roll_ds.agentic.parsers import ToolCall
from roll_ds.agentic.registry import ENVS, TOOLS


def call(expr: str, name: str = "calc") -> str:
    return f'<tool_call>{{"name":"{name}","arguments":{{"expr":"{expr}"}}}}</tool_call>'


# --- guess_number -----------------------------------------------------------------------------


def test_guess_number_reset_is_deterministic_and_in_range():
    env = GuessNumberEnv(low=1, high=16)
    secrets = []
    for seed in range(200):
        assert env.reset(seed) == "Guess a number 1-16."
        secrets.append(env.secret)
    again = GuessNumberEnv(low=1, high=16)
    assert [(again.reset(s), again.secret)[1] for s in range(200)] == secrets
    assert set(secrets) == set(range(1, 17))  # every value is reachable


def test_guess_number_feedback_then_success():
    env = GuessNumberEnv(low=1, high=16)
    seed = next(s for s in range(100) if _secret(s) == 11)
    env.reset(seed)
    low = env.step("8")
    assert (low.observation, low.reward, low.done, low.info) == ("higher", 0.0, False, {})
    high = env.step("my guess is 13, then 12")  # the first integer counts
    assert (high.observation, high.done) == ("lower", False)
    win = env.step(" 11")
    assert (win.reward, win.done, win.info) == (1.0, True, {"success": True})


def test_guess_number_without_a_number_is_a_format_error():
    env = GuessNumberEnv()
    assert env.reset(0) == "Guess a number 1-32."  # the default range
    result = env.step("higher please")
    assert result.observation == "Reply with a number."
    assert (result.reward, result.done, result.info) == (0.0, False, {"format_error": True})
    assert env.guesses == 0


def test_guess_number_optional_guess_limit():
    env = GuessNumberEnv(low=1, high=16, max_guesses=2)
    env.reset(0)
    wrong = next(g for g in range(1, 17) if g != env.secret)
    assert not env.step(str(wrong)).done
    last = env.step(str(wrong))
    assert last.done and last.reward == 0.0 and last.info == {"success": False}


def test_guess_number_rejects_bad_config():
    with pytest.raises(ValueError, match="low"):
        GuessNumberEnv(low=5, high=4)
    with pytest.raises(ValueError, match="max_guesses"):
        GuessNumberEnv(max_guesses=0)


def _secret(seed: int) -> int:
    env = GuessNumberEnv(low=1, high=16)
    env.reset(seed)
    return env.secret


# --- calculator -------------------------------------------------------------------------------


def test_calculator_task_is_deterministic_two_digit_product():
    env = CalculatorEnv()
    tasks = [env.reset(seed) for seed in range(50)]
    assert tasks == [CalculatorEnv().reset(seed) for seed in range(50)]
    for task in tasks:
        a, b = task.removesuffix("=").split("*")
        assert len(a) == len(b) == 2
    assert len(set(tasks)) > 40


def test_calculator_tool_call_then_answer():
    env = CalculatorEnv()
    task = env.reset(1)
    expr = task.removesuffix("=")
    product = _product(task)
    result = env.step(call(expr))
    assert result.observation == [{"role": "tool", "content": str(product)}]
    assert (result.reward, result.done) == (0.0, False)
    assert result.info == {
        "tool_calls": 1,
        "tool_calls_refused": 0,
        "tool_error": False,
        "format_error": False,
    }
    final = env.step(f"{product}")
    assert (final.reward, final.done, final.info["success"]) == (1.0, True, True)


def _product(task: str) -> int:
    a, b = task.removesuffix("=").split("*")
    return int(a) * int(b)


def test_calculator_scores_the_last_integer():
    env = CalculatorEnv()
    product = _product(env.reset(2))
    assert env.score(f"the answer is {product}") == 1.0
    assert env.score(f"{product} or {product + 1}") == 0.0
    assert env.score("no idea") == 0.0
    wrong = env.step(str(product + 1))
    assert (wrong.reward, wrong.done, wrong.info["success"]) == (0.0, True, False)


def test_calculator_call_limit():
    env = CalculatorEnv(max_tool_calls=1)
    env.reset(0)
    assert not env.step(call("1+1")).info["tool_error"]
    over = env.step(call("2+2"))
    assert over.info["tool_error"] and not over.done
    assert over.observation == [{"role": "tool", "content": "too many tool calls (max 1)"}]


@pytest.mark.parametrize(
    ("expr", "value"),
    [("37*89", 3293), ("(2+3)*4", 20), ("-7//2", -4), ("17%5", 2), ("2**10", 1024), (" 1 ", 1)],
)
def test_safe_eval_arithmetic(expr, value):
    assert safe_eval(expr) == value


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("__import__('os').system('true')", "unsupported syntax: Call"),
        ("x+1", "unsupported syntax: Name"),
        ("(1).real", "unsupported syntax: Attribute"),
        ("[1, 2]", "unsupported syntax: List"),
        ("lambda: 1", "unsupported syntax: Lambda"),
        ("9**9**9", "exponent must be"),
        ("2**-1", "exponent must be"),
        ("99999**60", "result too large"),
        ("9" * 100, "result too large"),
        ("1.5*2", "only integers"),
        ("True+1", "only integers"),
        ("'a'*3", "only integers"),
        ("7/2", "use //"),
        ("1+", "not an arithmetic expression"),
        ("1+" * 150 + "1", "longer than"),
    ],
)
def test_safe_eval_refuses(expr, reason):
    with pytest.raises(ValueError, match=reason):
        safe_eval(expr)


def test_calculator_tool_errors_become_observations():
    env = CalculatorEnv()
    env.reset(0)
    for action, text in [
        (call("x*2"), "unsupported syntax: Name"),
        (call("1//0"), "ZeroDivisionError"),
        (call("2**999"), "exponent must be"),
    ]:
        result = env.step(action)
        assert not result.done and result.reward == 0.0
        assert result.info["tool_error"] and not result.info["format_error"]
        [message] = result.observation
        assert message["role"] == "tool" and text in message["content"]
        env.reset(0)


def test_calculator_tool_schema_and_direct_call():
    assert CALCULATOR_TOOL.schema()["function"]["name"] == "calc"
    assert CALCULATOR_TOOL(ToolCall("calc", {"expr": "6*7"})) == ("42", None)
    output, error = CALCULATOR_TOOL(ToolCall("calc", {"expr": 42}))
    assert error == output and "bad arguments" in error


def test_registry_names_resolve_to_the_shipped_envs():
    assert ENVS.get("guess_number") is GuessNumberEnv
    assert ENVS.get("calculator") is CalculatorEnv
    assert TOOLS.get("calculator") is CALCULATOR_TOOL
    assert CalculatorEnv().tools == [CALCULATOR_TOOL.schema()]
