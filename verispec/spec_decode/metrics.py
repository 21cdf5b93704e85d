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

    def as_dict(self) -> dict:
        # Tokens emitted per verify step: the accepted drafts plus the one recovered/bonus token.
        mean = 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": mean,
        }
