"""Prompt-lookup (n-gram) drafter: proposes the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, trying n from prompt_lookup_max down to
prompt_lookup_min. It has no probabilities: verification treats its q as one-hot."""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        # Latest earlier match first: recent context predicts the continuation best.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []
