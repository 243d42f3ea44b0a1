"""An environment's over-long reply cut to a token budget, without tokenising all of it.

A tool can answer with a megabyte of text. Tokenising it whole costs about a second per million
tokens, the episode then ends at the context limit anyway, and the text goes into every dump of
the episode. ``ObservationCutter.cut`` cuts a message's text to ``max_tokens`` tokens, a marker
where the rest was included (at least the marker and two tokens of text are kept):

    right   keep the start:  "<first tokens>\\n[... 1046528 characters truncated ...]"
    left    keep the end:    "[... 1046528 characters truncated ...]\\n<last tokens>"
    middle  keep both ends:  "<first half>\\n[... N characters truncated ...]\\n<last half>"

(the side named is the side cut, as in transformers' ``truncation_side``). Only a window of the
text is tokenised: the first (or last) ``4 x (max_tokens + 8)`` characters, doubled until it
holds more than ``max_tokens + 8`` tokens or is the whole text, so the cost follows the budget,
not the text. Characters are counted on the text, tokens only within the window; the kept text
ends on a token boundary of the window (character offsets of a fast tokenizer, else the decoded
tokens), and is re-tokenised where the chat template places it, so the model sees exactly the
text the episode records.
"""

from __future__ import annotations

from typing import Any

from roll_ds.agentic.env import Message
from roll_ds.config.agentic import TRUNCATION_SIDES

CHARS_PER_TOKEN_GUESS = 4  # a first window; it doubles while it holds too few tokens
SLACK = 8  # tokens past the budget a window must hold: a cut mid-word re-forms its last tokens


def marker(chars_cut: int) -> str:
    return f"[... {chars_cut} characters truncated ...]"


class ObservationCutter:
    """Cuts texts to a token budget with ``tokenizer`` (a transformers tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._offsets = bool(getattr(tokenizer, "is_fast", False))

    def cut_messages(
        self, messages: list[Message], max_tokens: int | None, side: str = "middle"
    ) -> tuple[list[Message], int]:
        """``messages`` with each text content cut to ``max_tokens`` (None: as they are), and
        how many were cut."""
        if max_tokens is None:
            return messages, 0
        kept, cut_count = [], 0
        for message in messages:
            content = message["content"]
            if isinstance(content, str):
                content, cut = self.cut(content, max_tokens, side)
                cut_count += cut
            kept.append({**message, "content": content})
        return kept, cut_count

    def cut(self, text: str, max_tokens: int, side: str = "middle") -> tuple[str, bool]:
        """``(text, False)`` when it is at most ``max_tokens`` tokens; else the kept part with
        the marker, and True."""
        if side not in TRUNCATION_SIDES:
            raise ValueError(f"truncation side {side!r}; valid: {', '.join(TRUNCATION_SIDES)}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if self._span(text, max_tokens, from_start=True) is None:
            return text, False  # the whole text is within the budget
        # the marker counts against the budget (its count has at most len(text)'s digits)
        keep = max(max_tokens - len(self._encode(f"\n{marker(len(text))}\n")[0]), 2)
        # (a span of None, the text within it, cannot follow a longer text's: kept whole)
        if side == "right":
            head = _or(self._span(text, keep, from_start=True), len(text))
            return f"{text[:head]}\n{marker(len(text) - head)}", True
        if side == "left":
            start = _or(self._span(text, keep, from_start=False), 0)
            return f"{marker(start)}\n{text[start:]}", True
        head = _or(self._span(text, (keep + 1) // 2, from_start=True), len(text))
        start = max(_or(self._span(text, keep // 2, from_start=False), len(text)), head)
        return f"{text[:head]}\n{marker(start - head)}\n{text[start:]}", True

    def _span(self, text: str, n: int, *, from_start: bool) -> int | None:
        """Where the first (``from_start``) or last ``n`` tokens of ``text`` end (or start), as a
        character index; None when the whole text is at most ``n`` tokens."""
        width = CHARS_PER_TOKEN_GUESS * (n + SLACK)
        while True:
            window = text[:width] if from_start else text[-width:]
            ids, offsets = self._encode(window)
            whole = len(window) == len(text)
            if whole and len(ids) <= n:
                return None
            if whole or len(ids) > n + SLACK:
                break
            width *= 2
        if from_start:
            return self._end_of(window, ids, offsets, n)
        return len(text) - len(window) + self._start_of(window, ids, offsets, n)

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        if self._offsets:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), None

    def _end_of(self, window: str, ids: list[int], offsets: Any, n: int) -> int:
        if offsets is not None:
            return offsets[n - 1][1]
        return len(self.tokenizer.decode(ids[:n]))  # a slow tokenizer: by the decoded text

    def _start_of(self, window: str, ids: list[int], offsets: Any, n: int) -> int:
        if offsets is not None:
            return offsets[len(ids) - n][0]
        return len(window) - len(self.tokenizer.decode(ids[-n:]))


def _or(index: int | None, default: int) -> int:
    return default if index is None else index
