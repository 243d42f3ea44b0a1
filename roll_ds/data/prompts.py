"""Token ids of a task row's prompt: its text as is, or chat messages rendered with a template.

``data_args.template: raw`` tokenizes ``row["prompt"]`` as is (the embedded default's path).
``chat`` builds the messages (the row's ``messages`` list, or one user message holding its
prompt), puts ``data_args.system_prompt`` first when the messages have no system message, and
renders them with the chat template and the assistant's generation prompt. The template is the
tokenizer's own, or ``data_args.chat_template``: a name from ``CHAT_TEMPLATES`` or a Jinja text
(tokenizers without one, such as the embedded model's, need it). Rendering to text and then
tokenizing without added special tokens gives the ids ``apply_chat_template(tokenize=True)``
would.

No torch import: config validation uses ``chat_template_problems``.
"""

from __future__ import annotations

from typing import Any

# Plain ChatML (Qwen's turn markers, no default system message); the embedded tokenizer has
# <|im_start|> / <|im_end|> as special tokens.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_TEMPLATES = {"chatml": CHATML}


def _is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def chat_template_problems(data_args: Any) -> list[str]:
    """Problems of ``data_args.chat_template`` (config time; without the tokenizer)."""
    template = data_args.chat_template
    if template is None or template in CHAT_TEMPLATES or _is_jinja(template):
        return []
    return [
        f"{template!r} is neither a named template ({', '.join(CHAT_TEMPLATES)}) nor a Jinja "
        "template; use one of those, or null for the tokenizer's own"
    ]


def chat_messages(row: dict, system_prompt: str | None) -> list[dict[str, str]]:
    """The row's messages (or one user message with its prompt), the system prompt first when
    given and the messages have none."""
    messages = list(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def resolve_chat_template(tokenizer: Any, chat_template: str | None, where: str) -> str | None:
    """The template text to render with; None: the tokenizer's own. Raises ``ValueError``
    naming the field when the tokenizer has none and none is configured."""
    if chat_template is not None:
        return CHAT_TEMPLATES.get(chat_template, chat_template)
    if getattr(tokenizer, "chat_template", None):
        return None
    raise ValueError(
        f"{where}.data_args.chat_template: the tokenizer of "
        f"{getattr(tokenizer, 'name_or_path', '') or 'the model'} has no chat template, and "
        f"template=chat renders prompts with one; set {where}.data_args.chat_template=chatml "
        "(plain ChatML) or to a Jinja template, or use template=raw with text prompts"
    )


def render_chat(tokenizer: Any, row: dict, data_args: Any, where: str) -> str:
    """The prompt text the chat template makes of ``row``, ending in the generation prompt."""
    template = resolve_chat_template(tokenizer, data_args.chat_template, where)
    return tokenizer.apply_chat_template(
        chat_messages(row, data_args.system_prompt),
        chat_template=template,
        add_generation_prompt=True,
        tokenize=False,
    )


def prompt_token_ids(tokenizer: Any, row: dict, data_args: Any, where: str) -> list[int]:
    """Token ids of ``row``'s prompt under ``data_args.template`` (raw: the text as is)."""
    text = (
        row["prompt"]
        if data_args.template != "chat"
        else render_chat(tokenizer, row, data_args, where)
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
