"""Prompt lookup (spec_decode/ngram.py) against its definition."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from verispec.spec_decode.ngram import propose_ngram


def test_ngram_proposals():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 2, 1, 3) == [3, 4]
    assert propose_ngram([1, 2, 3], 2, 1, 3) == []
    assert propose_ngram([5, 6, 5, 6, 5], 3, 2, 2) == [6, 5]


def lookup_by_definition(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup as defined: the longest n first, then the latest earlier occurrence of the
    last n tokens that some token follows, every window compared in full."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == tokens[len(tokens) - n :]]
        if ends:
            return tokens[ends[-1] + 1 : ends[-1] + 1 + k]
    return []


@settings(max_examples=examples(300), deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=60), k=st.integers(1, 7), n_min=st.integers(1, 4),
       extra=st.integers(0, 3))
def test_ngram_proposals_follow_the_definition(tokens, k, n_min, extra):
    assert propose_ngram(tokens, k, n_min, n_min + extra) == lookup_by_definition(tokens, k, n_min, n_min + extra)
