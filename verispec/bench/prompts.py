"""The benchmark's prompts, rendered once with the model's chat template.

Every system gets the same token ids (or, for llama.cpp, the same text, which tokenizes to those
ids), so a difference in output comes from the system and never from the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def chat_prompts(tokenizer: Any, count: int) -> list[Prompt]:
    """The first `count` questions, each wrapped in the chat template as a user turn."""
    if not 1 <= count <= len(QUESTIONS):
        raise ValueError(f"count must be in [1, {len(QUESTIONS)}]; got {count}")
    out = []
    for question in QUESTIONS[:count]:
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        # transformers 5 returns a BatchEncoding here; 4.x returned a plain list.
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(Prompt(question=question, text=text, ids=[int(t) for t in ids]))
    return out
