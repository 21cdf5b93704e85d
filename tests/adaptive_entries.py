"""Hand-made scheduled entries for the adaptive plan's tests (test_budget, test_adaptive_controller)."""

from __future__ import annotations

from types import SimpleNamespace

from verispec.spec_decode.adaptive import RequestHistory


def entry(group: str, drafts: list[int], written: int = 0, greedy: bool = True):
    """A scheduled decode entry of a request of `group` that has written `written` of 64 tokens."""
    req = SimpleNamespace(params=SimpleNamespace(greedy=greedy), spec_history=None, draft_confidence=None,
                          group=group, max_tokens=64, num_output_tokens=written)
    return SimpleNamespace(request=req, draft_token_ids=list(drafts), samples=True, num_new_tokens=1)


def uniform_history(ctl, score: float):
    """A request history whose per-position confidence is `score` everywhere."""
    return RequestHistory(confidence=[score] * ctl.k)
