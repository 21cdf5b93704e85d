"""The drafter's training prompts (verispec/train/prompts.py): none is a benchmark question, and
the held-out prompts' topics are never trained on."""

from __future__ import annotations

from benchmarks.prompts import QUESTIONS
from verispec.train.prompts import HELD_OUT_TOPICS, TOPICS, held_out_prompts, training_prompts


def test_no_benchmark_question_or_held_out_topic_is_trained_on():
    train = training_prompts()
    assert len(train) == len(set(train)) == len(TOPICS) * 14
    assert not set(train) & set(QUESTIONS)
    assert not set(TOPICS) & set(HELD_OUT_TOPICS)
    assert not any(topic in p for p in train for topic in HELD_OUT_TOPICS)
    held = held_out_prompts()
    assert len(held) == len(HELD_OUT_TOPICS) and not set(held) & set(train)


def test_the_order_is_fixed_by_the_seed():
    assert training_prompts(0) == training_prompts(0) != training_prompts(1)
    assert held_out_prompts(3) == held_out_prompts()[:3]
