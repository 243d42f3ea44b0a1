"""Cutting an environment's over-long reply to a token budget (``roll_ds/agentic/truncation.py``)
with real tokenizers: the embedded one (a token per byte) and a byte-level BPE trained here (tokens
of several characters). A spy at the tokenizer boundary records how much text it was given."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from roll_ds.agentic.truncation import ObservationCutter
from roll_ds.models.shipped import EMBEDDED_MODEL, resolve_embedded

MEGABYTE = "".join(f"line {i}: value={i * 7919 % 10007} ok\n" for i in range(40_000))[:1_000_000]
MARKER = re.compile(r"\[\.\.\. (\d+) characters truncated \.\.\.\]")


class Spy:
    """A tokenizer that records the length of every text it tokenises."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []
        self.is_fast = tokenizer.is_fast

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)

    def decode(self, ids):
        return self.tokenizer.decode(ids)


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([MEGABYTE[:200_000], "héllo wörld 数字 " * 50], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module", params=["embedded", "bpe"])
def tokenizer(request):
    if request.param == "embedded":
        return AutoTokenizer.from_pretrained(resolve_embedded(EMBEDDED_MODEL))
    return bpe_tokenizer()


def parts(kept: str) -> tuple[str, int, str]:
    """The kept start, the characters the marker says were cut, the kept end."""
    (marker,) = MARKER.finditer(kept)
    head, tail = kept[: marker.start()], kept[marker.end() :]
    assert head == "" or head.endswith("\n")  # the marker sits on a line of its own
    assert tail == "" or tail.startswith("\n")
    return head[:-1], int(marker[1]), tail[1:]


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_a_megabyte_is_cut_to_the_budget_without_tokenising_it(tokenizer, side):
    spy = Spy(tokenizer)
    kept, cut = ObservationCutter(spy).cut(MEGABYTE, 64, side)
    assert cut
    assert max(spy.lengths) < 20_000  # windows of the text, never the megabyte
    head, chars_cut, tail = parts(kept)
    assert MEGABYTE.startswith(head) and MEGABYTE.endswith(tail)
    assert len(head) + chars_cut + len(tail) == len(MEGABYTE)  # the count is exact
    # the budget holds the marker too
    assert count(tokenizer, kept) == pytest.approx(64, abs=2)
    if side == "middle":
        assert count(tokenizer, head) == pytest.approx(count(tokenizer, tail), abs=1)


def test_a_text_within_the_budget_is_left_alone(tokenizer):
    text = MEGABYTE[:500]
    budget = count(tokenizer, text)
    assert ObservationCutter(tokenizer).cut(text, budget, "middle") == (text, False)
    kept, cut = ObservationCutter(tokenizer).cut(text, budget - 1, "right")
    assert cut and MARKER.search(kept)


def test_multibyte_text_is_cut_between_characters(tokenizer):
    text = "数字 héllo wörld " * 5_000
    kept, cut = ObservationCutter(tokenizer).cut(text, 51, "middle")
    head, chars_cut, tail = parts(kept)
    assert cut and text.startswith(head) and text.endswith(tail)  # no broken characters
    assert len(head) + chars_cut + len(tail) == len(text)
    assert "\ufffd" not in kept


def test_messages_are_cut_one_by_one_and_counted(tokenizer):
    cutter = ObservationCutter(tokenizer)
    messages = [{"role": "tool", "content": MEGABYTE}, {"role": "tool", "content": "42"}]
    kept, cut = cutter.cut_messages(messages, 16, "right")
    assert cut == 1 and kept[1] == messages[1] and kept[0]["role"] == "tool"
    assert len(kept[0]["content"]) < 200
    assert cutter.cut_messages(messages, None) == (messages, 0)  # no cap
    with pytest.raises(ValueError, match="valid: left, right, middle"):
        cutter.cut(MEGABYTE, 16, "top")
