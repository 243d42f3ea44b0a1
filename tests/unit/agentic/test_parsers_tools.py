"""The hermes tool-call parser and ``ToolEnv``'s turn loop: every malformed call becomes an
error observation and an ``info`` flag, never an exception."""

from __future__ import annotations

import pytest

from roll_ds.agentic.parsers import ToolCall, parse_hermes
from roll_ds.agentic.registry import TOOL_PARSERS
from roll_ds.agentic.tools import Tool, ToolEnv

# --- parse_hermes -----------------------------------------------------------------------------


def test_hermes_parses_compact_and_spaced_calls():
    turn = parse_hermes(
        'ok <tool_call>{"name":"calc","arguments":{"expr":"1+2"}}</tool_call>'
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "3"}}\n</tool_call> done'
    )
    assert turn.calls == [ToolCall("calc", {"expr": "1+2"}), ToolCall("calc", {"expr": "3"})]
    assert turn.errors == [] and turn.content == "ok  done" and turn.has_calls


def test_hermes_plain_text_has_no_calls():
    turn = parse_hermes(" 3293 ")
    assert (turn.content, turn.calls, turn.errors, turn.has_calls) == ("3293", [], [], False)


def test_hermes_arguments_as_json_string_and_missing_arguments():
    turn = parse_hermes('<tool_call>{"name":"f","arguments":"{\\"x\\": 1}"}</tool_call>')
    assert turn.calls == [ToolCall("f", {"x": 1})]
    assert parse_hermes('<tool_call>{"name":"f"}</tool_call>').calls == [ToolCall("f", {})]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{name: calc}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "f", "arguments": "nope"}</tool_call>', "not JSON"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": {}}', "unclosed"),
    ],
)
def test_hermes_malformed_calls_are_errors_not_exceptions(text, error):
    turn = parse_hermes(text)
    assert turn.calls == [] and turn.has_calls
    [message] = turn.errors
    assert error in message


def test_hermes_is_registered():
    assert TOOL_PARSERS.get("hermes") is parse_hermes


# --- ToolEnv ----------------------------------------------------------------------------------


def _boom(arguments):
    raise RuntimeError("disk on fire")


ECHO = Tool(
    name="echo",
    description="echo",
    parameters={
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
        "additionalProperties": False,
    },
    fn=lambda arguments: arguments["text"].upper(),
)
BOOM = Tool(name="boom", description="fails", parameters={"type": "object"}, fn=_boom)


class EchoEnv(ToolEnv):
    def __init__(self, **kwargs):
        super().__init__(tools=[ECHO, BOOM], **kwargs)

    def task(self, seed):
        return f"say {seed}"

    def score(self, answer):
        return 1.0 if answer == "HI" else 0.0


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def step_texts(env: ToolEnv, action: str):
    result = env.step(action)
    assert not result.done
    assert all(m["role"] == "tool" for m in result.observation)
    return [m["content"] for m in result.observation], result.info, result.reward


def test_tool_env_runs_a_call_then_scores_the_answer():
    env = EchoEnv()
    assert env.reset(3) == "say 3"
    assert env.tools == [ECHO.schema(), BOOM.schema()]
    texts, info, reward = step_texts(env, call("echo", '{"text": "hi"}'))
    assert texts == ["HI"] and reward == 0.0
    assert info == {
        "tool_calls": 1,
        "tool_calls_refused": 0,
        "tool_error": False,
        "format_error": False,
    }
    final = env.step("HI")
    assert (final.observation, final.reward, final.done) == ([], 1.0, True)
    assert final.info == {"success": True, "tool_calls": 0}


@pytest.mark.parametrize(
    ("action", "error", "format_error"),
    [
        ("<tool_call>{oops</tool_call>", "not valid JSON", True),
        (call("nope", "{}"), "unknown tool 'nope'; available: boom, echo", False),
        (call("echo", '{"txt": "hi"}'), "bad arguments: 'text' is a required property", False),
        (call("echo", '{"text": 5}'), "bad arguments: 5 is not of type 'string'", False),
        (call("echo", '{"text": "a", "x": 1}'), "bad arguments: Additional properties", False),
        (call("boom", "{}"), "tool 'boom' failed: RuntimeError: disk on fire", False),
    ],
)
def test_tool_env_bad_calls_become_one_error_observation(action, error, format_error):
    env = EchoEnv(tool_error_reward=-0.1)
    env.reset(0)
    texts, info, reward = step_texts(env, action)
    [text] = texts  # exactly one message: the error, not the error twice
    assert error in text
    assert info["tool_error"] and info["format_error"] == format_error
    assert reward == -0.1


def test_tool_env_limits_calls_per_episode_and_reset_clears_the_count():
    env = EchoEnv(max_tool_calls=2)
    env.reset(0)
    texts, info, _ = step_texts(env, call("echo", '{"text": "a"}') * 3)
    assert texts == ["A", "A", "too many tool calls (max 2)"]
    assert info["tool_error"] and (info["tool_calls"], info["tool_calls_refused"]) == (2, 1)
    texts, info, _ = step_texts(env, call("echo", '{"text": "b"}'))
    assert texts == ["too many tool calls (max 2)"]
    assert (info["tool_calls"], info["tool_calls_refused"]) == (0, 1)
    env.reset(1)
    assert step_texts(env, call("echo", '{"text": "c"}'))[0] == ["C"]


def test_tool_env_good_and_bad_calls_in_one_turn():
    env = EchoEnv()
    env.reset(0)
    texts, info, _ = step_texts(env, call("echo", '{"text": "ok"}') + "<tool_call>{</tool_call>")
    assert texts[0] == "OK" and "not valid JSON" in texts[1] and len(texts) == 2
    assert info == {
        "tool_calls": 1,
        "tool_calls_refused": 0,
        "tool_error": True,
        "format_error": True,
    }


def test_tool_env_unknown_parser_lists_the_valid_ones():
    with pytest.raises(ValueError, match="hermes"):
        EchoEnv(parser="nope")


def test_a_bad_tool_schema_is_an_error_at_registration_naming_the_tool():
    bad = {"type": "object", "properties": {"text": {"type": "strng"}}}
    with pytest.raises(
        ValueError, match=r"tool 'typo': .*not a valid JSON schema.*properties/text"
    ):
        Tool(name="typo", description="", parameters=bad, fn=lambda a: "")


def test_the_schema_is_checked_once_and_the_validator_kept(monkeypatch):
    import jsonschema

    tool = Tool(name="echo2", description="", parameters=ECHO.parameters, fn=ECHO.fn)
    cls = jsonschema.validators.validator_for(tool.parameters)
    checks = []
    monkeypatch.setattr(cls, "check_schema", classmethod(lambda c, s, **k: checks.append(s)))
    for arguments in ({"text": "a"}, {"txt": "a"}, {"text": 5}):
        tool.argument_error(arguments)
    assert checks == []  # jsonschema.validate checked the schema again on every call
    assert (
        tool.argument_error({"text": 5}) == "tool 'echo2': bad arguments: 5 is not of type 'string'"
    )
