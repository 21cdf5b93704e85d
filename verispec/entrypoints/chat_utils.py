"""Chat messages -> prompt token ids, the one way both `LLM.chat` and the server do it.

Only the chat template makes control tokens. Message content that spells one (`<|im_end|>`) stays
text: the template is rendered around a placeholder per such content, its own text is tokenized
with control tokens and the content without. Content that spells none (nearly all) takes the
template's own tokenization unchanged. Other client strings the template renders (names, tool
calls, tool definitions) may not spell a control token at all.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from verispec.tokenization import TextEncoder, text_encoder


def chat_prompt_ids(
    tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Applies the tokenizer's chat template; raises ValueError (naming `messages`) when the
    template rejects the conversation."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template; this model has none")
    if not messages:
        raise ValueError("messages must hold at least one message")
    enc = text_encoder(tokenizer)
    _refuse_specials_outside_content(enc, messages, tools)
    render = dict(add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                  **({"tools": tools} if tools else {}))  # a template that knows tools lists them for the model
    marks = {i: f"\ue000{uuid.uuid4().hex}\ue001" for i, m in enumerate(messages)
             if isinstance(m.get("content"), str) and enc.find_special(m["content"])}
    if not marks:
        ids = _apply(tokenizer, messages, tokenize=True, **render)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    masked = [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)]
    text = _apply(tokenizer, masked, tokenize=False, **render)
    return _encode_around(enc, text, {marks[i]: messages[i]["content"] for i in marks})


def _apply(tokenizer, messages, **kw):
    try:
        return tokenizer.apply_chat_template(messages, **kw)
    except Exception as exc:  # jinja raises its own types for a conversation the template refuses
        raise ValueError(f"messages could not be rendered by the chat template: {exc}") from exc


def _encode_around(enc: TextEncoder, text: str, contents: dict[str, str]) -> list[int]:
    """The template's text with control tokens, each placeholder replaced by its content as text."""
    found = []
    for mark in contents:
        if text.count(mark) != 1:
            raise ValueError("messages: a content holds special-token text, and this chat template does not "
                             "render content verbatim, so it cannot be kept as text")
        found.append((text.index(mark), mark))
    ids, pos = [], 0
    for start, mark in sorted(found):
        ids += enc.encode([text[pos:start]], special_tokens=True)[0] + enc.encode([contents[mark]], special_tokens=False)[0]
        pos = start + len(mark)
    return ids + enc.encode([text[pos:]], special_tokens=True)[0]


def _refuse_specials_outside_content(enc: TextEncoder, messages: list[dict[str, Any]], tools) -> None:
    for i, m in enumerate(messages):
        for key, value in m.items():
            if key == "content" or value is None:
                continue
            special = enc.find_special(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            if special is not None:
                raise ValueError(f"messages[{i}].{key} holds the control token text {special!r}, which only the "
                                 "chat template may produce")
    if tools:
        special = enc.find_special(json.dumps(tools, ensure_ascii=False))
        if special is not None:
            raise ValueError(f"tools hold the control token text {special!r}, which only the chat template may produce")
