"""Chat messages to prompt token ids: the tokenizer's chat template, and what happens to text in a
message that spells a special token (`<|im_end|>`, ...).

With `special_tokens="escape"` (the server's default) such text in message content is tokenised as
plain text, so a client cannot forge a turn boundary or a role; only the template's own markup becomes
control tokens. With "allow" the rendered prompt is tokenised in one pass, as vLLM and SGLang do by
default, and content can contain control tokens.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

SpecialTokens = Literal["escape", "allow"]

# ChatML, for tokenizers that ship no chat template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template could not render these messages."""


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat: the tokenizer's chat template, or ChatML when it has none, with the
    assistant's turn opened (unless asked not to)."""
    template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    try:
        return str(tokenizer.apply_chat_template(messages, chat_template=template,
                                                 add_generation_prompt=add_generation_prompt, tokenize=False))
    except Exception as e:  # noqa: BLE001 - a template may raise anything on messages it rejects
        raise ChatTemplateError(str(e)) from None


def special_token_texts(tokenizer: Any) -> list[str]:
    """The texts the tokenizer turns into added (control) tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {t.content for t in decoder.values()} | set(getattr(tokenizer, "all_special_tokens", []))
    return sorted(t for t in texts if t)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], special_tokens: SpecialTokens,
                specials: list[str], add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids of a chat. Content spelling one of `specials` is escaped unless special_tokens is
    "allow": the template is rendered around placeholders, its markup tokenised as usual and each
    content tokenised with special tokens split into plain text. Chats without such content take the
    one-pass path, so their ids do not depend on the setting."""
    forged = special_tokens == "escape" and any(s in m["content"] for m in messages for s in specials)
    if not forged:
        return list(tokenizer.encode(chat_prompt(tokenizer, messages, add_generation_prompt), add_special_tokens=False))
    marks = [f"\x00{uuid.uuid4().hex}\x00" for _ in messages]
    text = chat_prompt(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)], add_generation_prompt)
    ids: list[int] = []
    for m, mark in zip(messages, marks):
        head, found, text = text.partition(mark)
        if not found:
            raise ChatTemplateError("the chat template changes message content, so special tokens in it "
                                    "cannot be escaped")
        ids += tokenizer.encode(head, add_special_tokens=False)
        ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
    ids += tokenizer.encode(text, add_special_tokens=False)
    return ids
