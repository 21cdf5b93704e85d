"""Speculative decoding counters, cumulative over the engine's life (the server exports the same)."""

from __future__ import annotations


class SpecDecodeMetrics:
    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0  # verify steps of a request that carried at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1
