"""Hand-made scheduled entries for the adaptive plan's tests (test_budget, test_adaptive_controller)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from verispec.core.step_types import Drafts

_ids = itertools.count()


def entry(group: str, drafts: list[int], written: int = 0, greedy: bool = True):
    """A scheduled decode entry of a request of `group` that has written `written` of 64 tokens,
    with `drafts` on offer."""
    req = SimpleNamespace(request_id=f"{group}#{next(_ids)}", params=SimpleNamespace(greedy=greedy), group=group,
                          max_tokens=64, num_output_tokens=written, token_ids=[], num_tokens=0)
    return SimpleNamespace(request=req, drafts=Drafts(tuple(drafts)), samples=True, num_new_tokens=1)


def uniform_history(ctl, e, score: float) -> None:
    """The entry's request gets a history whose per-position confidence is `score` everywhere."""
    history = ctl.history(e.request.request_id)
    history.confidence[:] = [score] * len(history.confidence)


def plan_counts_of(ctl, entries) -> list[int]:
    """The drafts of each entry that the controller's plan keeps."""
    return ctl.plan(entries, [e.drafts for e in entries])[0]
