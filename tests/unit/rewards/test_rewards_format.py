"""String-level rewards: the format presets / regexes, exact match, and the boxed helper."""

from __future__ import annotations

import pytest

from roll_ds.rewards.base import find_boxed, last_boxed
from roll_ds.rewards.exact_match import ExactMatchReward
from roll_ds.rewards.format import FormatReward


def _ok(fn, response):
    out = fn([(response, "unused", "")])
    assert out.infos[0]["format_ok"] == (out.scores[0] == fn.correct_score)
    return out.infos[0]["format_ok"]


@pytest.mark.parametrize(
    ("preset", "good", "bad"),
    [
        (
            "bare_number",
            ["47", " 47\n", "-3", "+2", "0.5", ".5", "3/4", "1,000"],
            ["", "47.", "The answer is 47", "47 48", "forty", "4 7", "x", "47\n\nok"],
        ),
        (
            "bare_answer",
            ["47", "olleh", r"\frac{1}{2}", " dlrow "],
            ["", "two words", "a\nb"],
        ),
        (
            "boxed",
            [r"So \boxed{12}.", r"\boxed{\frac{1}{2}}", "reasoning\n...\n\\boxed{x^2}"],
            ["12", r"\boxed{}", r"\boxed{1} \boxed{2}", r"\boxed{12", r"\boxed { }"],
        ),
        (
            "think_boxed",
            ["<think>3+4=7</think> The answer is \\boxed{7}", "<think>\n</think>\\boxed{7}"],
            [
                r"\boxed{7}",
                r"<think>x</think>",
                r"<think>a</think><think>b</think>\boxed{7}",
                r"intro <think>a</think>\boxed{7}",
                r"<think>\boxed{7}</think>",
            ],
        ),
    ],
)
def test_presets(preset, good, bad):
    fn = FormatReward(preset=preset)
    assert [_ok(fn, r) for r in good] == [True] * len(good)
    assert [_ok(fn, r) for r in bad] == [False] * len(bad)


def test_custom_regex_fullmatch_and_search():
    full = FormatReward(pattern=r"Answer: \d+")
    assert _ok(full, "Answer: 12")
    assert not _ok(full, "So. Answer: 12")
    search = FormatReward(pattern=r"answer: \d+", match="search", flags=["IGNORECASE"])
    assert _ok(search, "So. Answer: 12")
    multiline = FormatReward(pattern=r"<a>.*</a>", flags=["DOTALL"])
    assert _ok(multiline, "<a>\nx\n</a>")


def test_scores_strip_and_max_chars():
    fn = FormatReward(preset="bare_number", correct_score=0.5, incorrect_score=-0.5)
    assert fn([("47", None), ("no", None)]).scores == [0.5, -0.5]
    assert not _ok(FormatReward(preset="bare_number", strip=False), " 47")
    assert not _ok(FormatReward(preset="bare_answer", max_chars=3), "abcd")
    assert _ok(FormatReward(preset="bare_answer", max_chars=4), "abcd")


def test_bad_configs_fail_with_valid_choices():
    with pytest.raises(ValueError, match="valid: bare_answer, bare_number, boxed, think_boxed"):
        FormatReward(preset="nope")
    with pytest.raises(ValueError, match="exactly one"):
        FormatReward()
    with pytest.raises(ValueError, match="exactly one"):
        FormatReward(preset="boxed", pattern="x")
    with pytest.raises(ValueError, match="unknown regex flag"):
        FormatReward(pattern="x", flags=["NOPE"])


def test_format_info_has_standard_keys():
    info = FormatReward(preset="boxed")([(r"\boxed{1}", "1")]).infos[0]
    assert info == {"format_ok": True, "timed_out": False, "error": None}


# -- exact match ---------------------------------------------------------------------------------


def test_exact_match_normalization():
    fn = ExactMatchReward()
    samples = [
        ("olleh", "olleh"),
        ("  olleh \n", "olleh"),
        ("dlrow  olleh", "dlrow olleh"),  # whitespace runs collapse
        ("Olleh", "olleh"),  # case-sensitive by default
        ("olle", "olleh"),
        ("", ""),  # an empty answer never matches
    ]
    assert fn(samples).scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    folded = ExactMatchReward(case_sensitive=False)
    assert folded([("OLLEH", "olleh"), ("Straße", "STRASSE")]).scores == [1.0, 1.0]
    punct = ExactMatchReward(strip_chars=".\"'")
    assert punct([('"olleh".', "olleh")]).scores == [1.0]


def test_exact_match_extraction_modes():
    auto = ExactMatchReward()
    assert auto([(r"Reversed: \boxed{olleh}", "olleh")]).scores == [1.0]
    out = auto([(r"\boxed{x} then \boxed{olleh}", "olleh")])
    assert out.scores == [1.0]
    assert out.infos[0]["extracted"] == "olleh"
    none = ExactMatchReward(extract="none")
    assert none([(r"\boxed{olleh}", "olleh")]).scores == [0.0]
    boxed = ExactMatchReward(extract="boxed")
    assert boxed([("olleh", "olleh"), (r"\boxed{olleh}", "olleh")]).scores == [0.0, 1.0]
    with pytest.raises(ValueError, match="valid: auto, none, boxed"):
        ExactMatchReward(extract="last_line")


def test_exact_match_gold_list_and_scores():
    fn = ExactMatchReward(correct_score=3.0, incorrect_score=-1.0)
    out = fn([("b", ["a", "b"]), ("c", ["a", "b"]), ("12", 12)])
    assert out.scores == [3.0, -1.0, 3.0]
    assert [i["correct"] for i in out.infos] == [True, False, True]


# -- boxed helper ------------------------------------------------------------------------------


def test_find_boxed():
    assert find_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == ["1", r"\frac{1}{2}"]
    assert find_boxed(r"\boxed{\boxed{1}}") == [r"\boxed{1}"]  # nested: one box
    assert find_boxed(r"\boxed{a\}b}") == [r"a\}b"]  # escaped braces do not close it
    assert find_boxed(r"\boxed{12") == [None]
    assert find_boxed(r"\fbox{3}") == ["3"]
    assert find_boxed("no box") == []
    assert last_boxed(r"\boxed{1} \boxed{2} \boxed{3") == "2"
