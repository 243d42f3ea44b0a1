"""The episode runner's token bookkeeping, limits and failure handling, on real environments
(guess_number, calculator and two misbehaving ones) with a scripted generate function in place
of the rollout engines."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from roll_ds.agentic.chat import ChatFormat
from roll_ds.agentic.env import Env, StepResult
from roll_ds.agentic.env_pool import EnvTypeSpec, LocalEnvPool
from roll_ds.agentic.episode import CONTEXT_LIMIT, DONE, ENV_ERROR, ENV_TIMEOUT, MAX_TURNS
from roll_ds.agentic.registry import ENVS
from roll_ds.agentic.runner import (
    EpisodeRunner,
    EpisodeSpec,
    TurnLimits,
    episode_metrics,
    one_sample_each,
)
from roll_ds.models.shipped import EMBEDDED_MODEL, resolve_embedded

TEMPLATE = (
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_start|>={{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_start|>{{ m['content'] }}<|im_end|>{%- endif -%}{%- endfor -%}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(resolve_embedded(EMBEDDED_MODEL))
    tok.chat_template = TEMPLATE
    return tok


class Scripted:
    """Plays scripted turns: ``script(episode_id, turn) -> text``; records every call."""

    def __init__(self, tokenizer, script, close: bool = True) -> None:
        self.tok, self.script, self.close = tokenizer, script, close
        self.calls: list[dict] = []
        self.turn: dict[int, int] = {}

    def __call__(self, contexts, max_new_tokens, rows, seed):
        self.calls.append({"contexts": contexts, "max": max_new_tokens, "rows": rows})
        ids, lps, reasons = [], [], []
        for row, limit in zip(rows, max_new_tokens, strict=True):
            turn = self.turn.get(row, 0)
            self.turn[row] = turn + 1
            out = self.tok(self.script(row, turn), add_special_tokens=False)["input_ids"]
            out = [*out, self.tok.eos_token_id] if self.close else out
            out = out[:limit]
            ids.append(out)
            lps.append([-0.5 - 0.01 * i for i in range(len(out))])
            reasons.append("stop" if out and out[-1] == self.tok.eos_token_id else "length")
        return {"response_ids": ids, "rollout_logprobs": lps, "finish_reason": reasons}


def runner(
    tokenizer,
    generate,
    specs,
    *,
    max_turns=6,
    per_turn=16,
    budget=200,
    timeout=5.0,
    cap=None,
    side="middle",
):
    pool = LocalEnvPool(specs, timeout)
    limits = {tag: TurnLimits(max_turns, per_turn, cap, side) for tag in specs}
    return EpisodeRunner(
        tokenizer=tokenizer,
        pool=pool,
        generate=one_sample_each(generate),
        limits=limits,
        max_context_tokens=budget,
        error_reward=-1.0,
    )


GUESS = {"guess": EnvTypeSpec("guess_number", {"low": 1, "high": 16})}


def binary_search(secrets):
    """A script that plays binary search from the feedback it has seen (tracked by turn)."""
    state = {}

    def script(row, turn):
        lo, hi = state.get(row, (1, 16))
        guess = (lo + hi) // 2
        secret = secrets[row]
        if secret > guess:
            state[row] = (guess + 1, hi)
        elif secret < guess:
            state[row] = (lo, guess - 1)
        return str(guess)

    return script


def test_tokens_are_generated_plus_observation_tokens_and_masks_exact(tokenizer):
    import random

    specs = [EpisodeSpec(i, i // 2, "guess", 100 + i // 2) for i in range(4)]
    secrets = {s.episode_id: random.Random(s.env_seed).randint(1, 16) for s in specs}
    gen = Scripted(tokenizer, binary_search(secrets))
    episodes, timings = runner(tokenizer, gen, GUESS).run(specs, seed=3)
    chat = ChatFormat(tokenizer)
    for ep in episodes:
        assert ep.status == DONE and ep.success and ep.total_reward == 1.0
        assert ep.prompt_ids == chat.prompt_ids(
            [{"role": "user", "content": "Guess a number 1-16."}]
        )
        # rebuild the sequence from what was generated and what the environment said
        rebuilt, mask = [], []
        for t, turn in enumerate(ep.turns):
            policy = tokenizer(turn["action"], add_special_tokens=False)["input_ids"] + [
                tokenizer.eos_token_id
            ]
            rebuilt += policy
            mask += [1] * len(policy)
            if t < len(ep.turns) - 1:
                obs = chat.observation_ids([{"role": "user", "content": turn["observation"]}])
                rebuilt += obs
                mask += [0] * len(obs)
        assert ep.token_ids == rebuilt
        assert ep.policy_mask == mask
        assert len(ep.logprobs) == len(ep.token_ids)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, mask, strict=True) if not m)
    # every turn generated the running episodes' contexts exactly as they stood
    first = gen.calls[0]
    assert first["rows"] == [0, 1, 2, 3]
    assert first["contexts"][0] == episodes[0].prompt_ids
    assert timings["turns"] == max(e.num_turns for e in episodes)
    # the same environment seed gives the group the same task
    assert secrets[0] == secrets[1] and secrets[2] == secrets[3]


def test_max_turns_and_context_budget_end_episodes_with_a_status(tokenizer):
    specs = [EpisodeSpec(0, 0, "guess", 7)]
    always_wrong = Scripted(tokenizer, lambda row, turn: "0")  # never the secret (1..16)
    (ep,), _ = runner(tokenizer, always_wrong, GUESS, max_turns=3).run(specs, seed=0)
    assert ep.status == MAX_TURNS and ep.num_turns == 3 and not ep.success
    (ep,), _ = runner(tokenizer, Scripted(tokenizer, lambda r, t: "0"), GUESS, budget=30).run(
        specs, seed=0
    )
    assert ep.status == CONTEXT_LIMIT and ep.context_length <= 30


def test_turn_token_limit_truncates_and_closes_the_turn_outside_the_mask(tokenizer):
    specs = [EpisodeSpec(0, 0, "guess", 7)]
    gen = Scripted(tokenizer, lambda row, turn: "0000000000000", close=False)
    (ep,), _ = runner(tokenizer, gen, GUESS, max_turns=2, per_turn=4).run(specs, seed=0)
    assert all(m <= 4 for m in gen.calls[0]["max"])
    policy_tokens = sum(ep.policy_mask)
    assert policy_tokens == 8  # two turns of 4 tokens, no end-of-turn token generated
    first_obs = ep.token_ids[4]
    assert first_obs == tokenizer.eos_token_id and ep.policy_mask[4] == 0


class Crashing(Env):
    def reset(self, seed):
        return "go"

    def step(self, action):
        raise RuntimeError("environment bug")


class Hanging(Env):
    def reset(self, seed):
        return "go"

    def step(self, action):
        time.sleep(30)
        return StepResult("late")


MEGABYTE = "".join(f"row {i}: {i * 7919 % 10007}\n" for i in range(100_000))[:1_000_000]


class Flood(Env):
    """A tool that answers every turn with a megabyte of text."""

    def reset(self, seed):
        return "go"

    def step(self, action):
        return StepResult([{"role": "tool", "content": MEGABYTE}])


@pytest.fixture(scope="module", autouse=True)
def _register_bad_envs():
    if "test_crashing" not in ENVS:
        ENVS.add("test_crashing", Crashing)
        ENVS.add("test_hanging", Hanging)
        ENVS.add("test_flood", Flood)


class LongestText:
    """The policy tokenizer, recording the longest text it is asked to tokenise."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_megabyte_tool_answer_is_cut_and_recorded_as_the_model_saw_it(tokenizer):
    counting = LongestText(tokenizer)
    flood = {"flood": EnvTypeSpec("test_flood")}
    group = [EpisodeSpec(i, 0, "flood", 1) for i in range(2)]
    play = runner(counting, Scripted(tokenizer, lambda r, t: "call"), flood, max_turns=3,
                  per_turn=8, budget=400, cap=64, side="middle")  # fmt: skip
    episodes, _ = play.run(group, seed=0)
    assert counting.longest < 20_000  # the megabyte was never tokenised whole
    chat = ChatFormat(tokenizer)
    for ep in episodes:
        # the cut replies leave room to play every turn; each reply was cut once
        assert ep.status == MAX_TURNS and ep.num_turns == 3 and ep.truncated_observations == 3
        rebuilt = []
        for t, turn in enumerate(ep.turns):
            seen = turn["observation"]  # what goes to rollouts.jsonl
            assert len(seen) < 500 and "characters truncated ...]" in seen
            assert MEGABYTE.startswith(seen.split("\n[... ")[0])
            rebuilt += tokenizer("call", add_special_tokens=False)["input_ids"]
            rebuilt += [tokenizer.eos_token_id]
            if t < len(ep.turns) - 1:
                obs = chat.observation_ids([{"role": "tool", "content": seen}])
                assert len(obs) <= 64 + 4  # the cap (marker included) and the template's tokens
                rebuilt += obs
        assert ep.token_ids == rebuilt  # the model saw exactly the recorded text
    assert episode_metrics(episodes, "rollout")["rollout/truncated_observations"] == 3.0


def test_without_a_cap_a_megabyte_answer_ends_the_episode_at_the_context_limit(tokenizer):
    flood = {"flood": EnvTypeSpec("test_flood")}
    play = runner(tokenizer, Scripted(tokenizer, lambda r, t: "call"), flood, budget=400)
    (ep,), _ = play.run([EpisodeSpec(0, 0, "flood", 1)], seed=0)
    assert ep.status == CONTEXT_LIMIT and ep.num_turns == 1
    assert ep.turns[0]["observation"] == MEGABYTE and ep.truncated_observations == 0


def test_crashing_and_hanging_environments_end_their_episode_and_the_batch_goes_on(tokenizer):
    specs = {
        **GUESS,
        "crash": EnvTypeSpec("test_crashing"),
        "hang": EnvTypeSpec("test_hanging"),
    }
    eps = [
        EpisodeSpec(0, 0, "crash", 1),
        EpisodeSpec(1, 1, "hang", 1),
        EpisodeSpec(2, 2, "guess", 5),
    ]
    started = time.perf_counter()
    episodes, _ = runner(
        tokenizer, Scripted(tokenizer, lambda r, t: "0"), specs, timeout=0.5, max_turns=2
    ).run(eps, seed=0)
    assert time.perf_counter() - started < 10
    crash, hang, fine = episodes
    assert crash.status == ENV_ERROR and "environment bug" in crash.turns[-1]["observation"]
    assert hang.status == ENV_TIMEOUT and "step_timeout_s" in hang.turns[-1]["observation"]
    assert crash.total_reward == -1.0 and hang.total_reward == -1.0
    assert fine.status == MAX_TURNS
    metrics = episode_metrics(episodes, "rollout")
    assert metrics["env/errors"] == 1.0 and metrics["env/timeouts"] == 1.0
    assert metrics["rollout/end_env_error"] == pytest.approx(1 / 3)


def test_calculator_episode_counts_tool_calls_and_errors(tokenizer):
    specs = {"calc": EnvTypeSpec("calculator", {})}
    script = [
        '<tool_call>{"name":"calc","arguments":{"x":"1"}}</tool_call>',  # bad arguments
        "<tool_call>{not json}</tool_call>",  # malformed
        "12",  # final answer (wrong)
    ]
    gen = Scripted(tokenizer, lambda row, turn: script[turn])
    (ep,), _ = runner(tokenizer, gen, specs, per_turn=64, budget=1000).run(
        [EpisodeSpec(0, 0, "calc", 3)], seed=0
    )
    assert ep.status == DONE and not ep.success
    assert ep.tool_calls == 1 and ep.tool_errors == 2 and ep.format_errors == 1
    # the error texts came back as tool messages the model sees
    assert "bad arguments" in ep.turns[0]["observation"]
    assert "not valid JSON" in ep.turns[1]["observation"]


# --- dataset rows: episodes of one turn ------------------------------------------------------


def test_a_row_group_is_one_request_of_n_samples_and_its_episodes_end_after_one_turn(tokenizer):
    from roll_ds.agentic.runner import Sample

    calls = []

    def generate(requests):
        calls.append(list(requests))
        return [
            [Sample([7, j, 2], [-0.1, -0.2, -0.3], "stop") for j in range(r.n)] for r in requests
        ]

    play = EpisodeRunner(
        tokenizer=tokenizer,
        pool=None,  # rows need no environment workers
        generate=generate,
        limits={},
        max_context_tokens=64,
        row_max_new_tokens=5,
    )
    specs = [
        EpisodeSpec(-1 - i, g, "math", prompt_ids=[1, 2, 3 + g], row=10 + g, index=g)
        for g in range(2)
        for i in range(3)
    ]
    episodes, timings = play.run(specs, seed=123, row_seed=77)
    [turn] = calls  # one turn, one request per group of 3
    assert [(r.context, r.n, r.index, r.seed, r.max_new_tokens) for r in turn] == [
        ([1, 2, 3], 3, 0, 77, 5),
        ([1, 2, 4], 3, 1, 77, 5),
    ]
    assert [e.token_ids for e in episodes[:3]] == [[7, 0, 2], [7, 1, 2], [7, 2, 2]]
    assert all(e.status == DONE and e.num_turns == 1 and e.row >= 10 for e in episodes)
    assert episodes[0].finish_reason == "stop" and episodes[0].policy_mask == [1, 1, 1]
    assert timings["turns"] == 1


def test_a_mixed_batch_plays_rows_and_environment_episodes_in_one_run(tokenizer):
    """Rows end after the first turn; the environment episodes go on, alone, in later turns
    (the requests of one turn differ in n and seed: the engines' handle makes a call of each)."""
    from roll_ds.agentic.runner import Sample

    calls = []

    def generate(requests):
        calls.append(list(requests))
        out = []
        for r in requests:
            text = "0" if r.n == 1 else "12"
            ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
            out.append([Sample(ids, [-0.5] * len(ids), "stop") for _ in range(r.n)])
        return out

    pool = LocalEnvPool(GUESS, 5.0)
    play = EpisodeRunner(
        tokenizer=tokenizer,
        pool=pool,
        generate=generate,
        limits={"guess": TurnLimits(3, 8)},
        max_context_tokens=200,
        row_max_new_tokens=4,
    )
    rows = [EpisodeSpec(-1 - i, 0, "math", prompt_ids=[1, 2], row=0, index=0) for i in range(2)]
    envs = [EpisodeSpec(i, 1, "guess", 5) for i in range(2)]
    episodes, _ = play.run(rows + envs, seed=9, row_seed=4)
    assert [len(c) for c in calls] == [3, 2, 2]  # the row group's request only in turn 0
    assert (calls[0][0].n, calls[0][0].seed) == (2, 4)
    assert [r.n for r in calls[0][1:]] == [1, 1] and calls[1][0].seed != calls[0][1].seed
    row, _, env, _ = episodes
    assert row.num_turns == 1 and row.status == DONE
    assert env.status == MAX_TURNS and env.num_turns == 3


def test_rollouts_jsonl_holds_each_episode_s_first_observation(tokenizer, tmp_path):
    import json

    from roll_ds.pipeline.packing import pack_episodes
    from roll_ds.pipeline.reporting import dump_rollouts
    from roll_ds.tracking import ROLLOUTS_FILE

    specs = [EpisodeSpec(i, i, "guess", 100 + i) for i in range(2)]
    episodes, _ = runner(tokenizer, Scripted(tokenizer, lambda row, turn: "8"), GUESS).run(
        specs, seed=3
    )
    task = [{"role": "user", "content": "Guess a number 1-16."}]  # as the chat template got it
    assert [e.first_observation for e in episodes] == [task] * 2
    dump_rollouts(tmp_path, 1, pack_episodes(episodes, [], pad_id=0), use_critic=False)
    dumped = [json.loads(line) for line in (tmp_path / ROLLOUTS_FILE).read_text().splitlines()]
    assert [d["prompt"] for d in dumped] == [task] * 2
    assert dumped[0]["turns"][0]["action"] == "8"  # the turns follow the first observation
