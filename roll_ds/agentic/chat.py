"""Messages -> tokens, one piece at a time, so earlier turns are never re-tokenised.

An episode's token sequence is built as

    prompt_ids(first messages)                       the chat template, generation prompt on
    + the policy's tokens exactly as vLLM sampled them (ending with the end-of-turn token)
    + observation_ids(new messages)                  what the template puts between that turn
    + the policy's next tokens ...                   and the next generation prompt

``observation_ids`` renders a fixed two-message conversation with and without the new messages
and keeps the difference after the assistant's end-of-turn token: exactly the tokens the chat
template would place there, tokenised on their own. A template that rewrites history (drops
earlier reasoning, re-formats earlier calls) therefore cannot change tokens the policy already
produced, and vLLM's log-probs stay comparable with the trainer's over the whole sequence.

The end-of-turn token is the tokenizer's EOS (``<|im_end|>`` for Qwen2.5 instruct models and the
embedded agent). A turn cut off at the token limit gets one appended, outside the loss mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from roll_ds.agentic.env import Message

_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ChatFormat:
    """Renders an episode's messages with ``tokenizer``'s chat template (``tools`` go to the
    template's ``tools=``)."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the policy tokenizer has no chat template; agentic episodes are rendered with "
                "it. Use an instruct model (or embedded:tiny-agent), or set one in the model's "
                "tokenizer_config.json"
            )
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.eos_id = int(tokenizer.eos_token_id)
        self.eos_text = tokenizer.convert_ids_to_tokens(self.eos_id)
        self._cut = self._find_cut()

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first observation's tokens, ending with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def observation_ids(self, messages: Sequence[Message], *, closed: bool = True) -> list[int]:
        """Tokens after a policy turn: ``messages`` as the template renders them after an
        assistant message, then the next generation prompt. ``closed``: the policy's turn
        ended with the end-of-turn token (else one is put first)."""
        full = self.render([*_PROBE, *messages], generation_prompt=True)
        if full[: self._cut] != self._prefix:
            raise ValueError(
                "the chat template renders earlier messages differently once more follow; "
                "cannot append observations without re-tokenising earlier turns"
            )
        ids = self.encode(full[self._cut :])
        return ids if closed else [self.eos_id, *ids]

    def decode(self, ids: Sequence[int]) -> str:
        """A policy turn as the environment sees it (special tokens dropped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _find_cut(self) -> int:
        text = self.render(_PROBE, generation_prompt=False)
        marker = "a" + self.eos_text
        at = text.rfind(marker)
        if at < 0:
            raise ValueError(
                f"the chat template does not end an assistant message with the EOS token "
                f"{self.eos_text!r}; set the tokenizer's eos_token to its end-of-turn token"
            )
        self._prefix = text[: at + len(marker)]
        return len(self._prefix)
