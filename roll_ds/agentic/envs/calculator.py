"""Calculator: a product too hard to do in one's head, and a tool that computes it.

    reset(seed)   "37*89="                      two random ``digits``-digit numbers (the seed's)
    policy        <tool_call>{"name":"calc","arguments":{"expr":"37*89"}}</tool_call>
    tool message  "3293"                        (an error text when the call is malformed)
    policy        "3293"                        no tool call: the final answer, scored; done

The answer is right when its last integer equals the product (reward 1.0, info ``success``).
``calc`` evaluates integer arithmetic safely: the expression is parsed with ``ast`` and only
integer literals, ``+ - * // %``, unary minus and parentheses (and ``**`` with a small
exponent) are evaluated; names, attributes, calls, floats and oversized numbers are refused
with an error the policy sees as the tool's reply (``ToolEnv``), never an exception.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from roll_ds.agentic.tools import Tool, ToolEnv

MAX_EXPR_CHARS = 200
MAX_EXPONENT = 64
MAX_BITS = 256  # every intermediate result stays below 2**256

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_INTEGER = re.compile(r"-?\d+")


def safe_eval(expr: str) -> int:
    """The value of integer arithmetic ``expr``; ``ValueError`` (with a short reason) for
    anything else. ``ZeroDivisionError`` for a division by zero."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression ({exc.msg})") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise ValueError(f"only integers are allowed, got {node.value!r:.20}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if not 0 <= right <= MAX_EXPONENT:
                raise ValueError(f"exponent must be in 0..{MAX_EXPONENT}")
            if abs(left).bit_length() * right > MAX_BITS:
                raise ValueError("result too large")
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        raise ValueError("use // for integer division")
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def _checked(value: int) -> int:
    if abs(value).bit_length() > MAX_BITS:
        raise ValueError("result too large")
    return value


def _calc(arguments: dict[str, Any]) -> str:
    return str(safe_eval(arguments["expr"]))


CALCULATOR_TOOL = Tool(
    name="calc",
    description="Evaluate integer arithmetic (+ - * // % and parentheses), e.g. 37*89.",
    parameters={
        "type": "object",
        "properties": {"expr": {"type": "string", "description": "the expression"}},
        "required": ["expr"],
        "additionalProperties": False,
    },
    fn=_calc,
)


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (None when there is none)."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


class CalculatorEnv(ToolEnv):
    """``digits``: the size of both factors; ``max_tool_calls``: calls per episode."""

    def __init__(
        self,
        *,
        digits: int = 2,
        max_tool_calls: int = 2,
        parser: str = "hermes",
        tool_error_reward: float = 0.0,
    ) -> None:
        if not 1 <= digits <= 6:
            raise ValueError(f"calculator: digits={digits} must be in 1..6")
        super().__init__(
            tools=[CALCULATOR_TOOL],
            parser=parser,
            max_tool_calls=max_tool_calls,
            tool_error_reward=tool_error_reward,
        )
        self.digits = digits
        self.result: int | None = None

    def task(self, seed: int) -> str:
        rng = random.Random(seed)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        self.result = a * b
        return f"{a}*{b}="

    def score(self, answer: str) -> float:
        if self.result is None:
            raise RuntimeError("calculator: step() before reset()")
        return 1.0 if last_integer(answer) == self.result else 0.0
