"""The benchmark's prompts, rendered once with the model's chat template.

Every system gets the same token ids (or, for llama.cpp, the same text, which tokenizes to those
ids), so a difference in output comes from the system and never from the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.texts import (
    EXTRA_DOCS,
    EXTRACTIVE_INSTRUCTION,
    LONG_QUESTION,
    REPORT,
)

# Sixteen different questions of varied length, so the batch scenario's sequences really differ
# (distinct prompt lengths exercise padding in HF and ragged batching in verispec).
QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain in simple terms how a rainbow forms.",
    "Write a short poem about the sea.",
    "List three tips for staying productive when working from home.",
    "What is the difference between a virus and a bacterium?",
    "Describe how to make a cup of tea.",
    "Why is the sky blue?",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What are the main causes of climate change?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How does a computer store numbers?",
    "Suggest a name for a friendly robot and explain why.",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Explain what a prime number is, with an example.",
    "Tell me a fun fact about octopuses.",
    "How can I improve my sleep?",
)


@dataclass(slots=True)
class Prompt:
    question: str
    text: str  # chat-templated text, generation prompt included
    ids: list[int]  # the same text, tokenized


def _render(tokenizer: Any, question: str, content: str) -> Prompt:
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    # transformers 5 returns a BatchEncoding here; 4.x returned a plain list.
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return Prompt(question=question, text=text, ids=[int(t) for t in ids])


def chat_prompts(tokenizer: Any, count: int) -> list[Prompt]:
    """The first `count` questions, each wrapped in the chat template as a user turn."""
    if not 1 <= count <= len(QUESTIONS):
        raise ValueError(f"count must be in [1, {len(QUESTIONS)}]; got {count}")
    return [_render(tokenizer, q, q) for q in QUESTIONS[:count]]


def extractive_prompt(tokenizer: Any) -> Prompt:
    """One long summarization prompt (about 630 tokens) whose answer copies the source's wording."""
    return _render(tokenizer, "extractive summary", EXTRACTIVE_INSTRUCTION + "\n\n" + "\n\n".join(REPORT))


def long_prompt(tokenizer: Any, target_tokens: int) -> Prompt:
    """A reading prompt of at least `target_tokens` tokens (whole paragraphs, so the text stays natural)."""
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be >= 1; got {target_tokens}")
    paragraphs = [*REPORT, *EXTRA_DOCS]
    docs: list[str] = []
    # Grow paragraph by paragraph; one more paragraph is at most ~150 tokens past the target.
    while True:
        docs.append(paragraphs[len(docs) % len(paragraphs)])
        prompt = _render(tokenizer, "long prompt", "\n\n".join(docs) + "\n\n" + LONG_QUESTION)
        if len(prompt.ids) >= target_tokens:
            return prompt
