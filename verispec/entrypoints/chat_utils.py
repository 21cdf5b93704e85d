"""Chat messages -> prompt token ids, the one way both `LLM.chat` and the server do it."""

from __future__ import annotations

from typing import Any


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
    try:
        extra = {"tools": tools} if tools else {}  # a template that knows tools lists them for the model
        ids = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, chat_template=chat_template, **extra
        )
    except Exception as exc:  # jinja raises its own types for a conversation the template refuses
        raise ValueError(f"messages could not be rendered by the chat template: {exc}") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
