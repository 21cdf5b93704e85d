"""Speculative decoding's counters (verispec/spec_decode/metrics.py): cumulative drafts, draft tokens,
accepted tokens, and acceptances per draft position, against counts done by hand."""

from __future__ import annotations

from verispec.spec_decode.metrics import SpecDecodeMetrics


def test_counts_add_up_over_verify_steps():
    m = SpecDecodeMetrics(num_speculative_tokens=3)
    m.observe(num_draft_tokens=3, num_accepted=2)
    m.observe(num_draft_tokens=2, num_accepted=0)
    m.observe(num_draft_tokens=3, num_accepted=3)
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (3, 8, 5)
    # Position j counts the steps that accepted at least j + 1 drafts.
    assert m.accepted_per_position == [2, 2, 1]


def test_a_fresh_counter_is_all_zero_with_one_slot_per_position():
    m = SpecDecodeMetrics(5)
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, m.accepted_per_position) == (0, 0, 0, [0] * 5)
