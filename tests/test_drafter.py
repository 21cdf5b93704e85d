"""Drafters' host side (spec_decode/drafter.py): how many drafts a request may carry, what prompt
lookup proposes at the end of a step, the placeholders of model drafters."""

from __future__ import annotations

from test_scheduler import make_request
from verispec.config import SpeculativeConfig
from verispec.spec_decode.drafter import ModelDrafter, NgramDrafter, draft_room
from verispec.spec_decode.metadata import PLACEHOLDER


def decoding(rid: str, prompt: list[int], max_tokens: int = 100, pending: int = 1):
    """A request whose prompt is computed and whose one new token (`pending`) waits for the next step."""
    req = make_request(rid, 1)
    req.prompt_token_ids, req.token_ids, req.max_tokens = prompt, prompt + [pending], max_tokens
    req.num_computed_tokens = len(prompt)
    return req


def test_draft_room_is_what_the_request_can_still_emit():
    req = decoding("a", [1, 2, 3, 1, 2, 3], max_tokens=3)
    assert draft_room(req, 5, max_model_len=100) == 2  # 3 tokens at most, 1 already out
    assert draft_room(req, 5, max_model_len=9) == 2 and draft_room(req, 5, max_model_len=8) == 1
    req.num_computed_tokens = 3  # still prefilling: nothing to speculate on
    assert draft_room(req, 5, max_model_len=100) == 0


def test_prompt_lookup_proposes_from_the_requests_own_tokens():
    drafter = NgramDrafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    repeat, fresh = decoding("r", [4, 5, 6, 7, 4, 5, 6, 7], pending=4), decoding("f", [20, 21, 22, 23], pending=24)
    drafter.propose([repeat, fresh], max_model_len=100)
    assert repeat.draft_token_ids == [5, 6, 7] and fresh.draft_token_ids == []


def test_model_drafters_reserve_placeholders_except_for_constrained_requests():
    drafter = ModelDrafter(SpeculativeConfig(method="layer_skip", num_speculative_tokens=3, num_layers=1))
    free, constrained = decoding("a", [1, 2, 3]), decoding("b", [1, 2, 3])
    constrained.grammar = object()  # its drafts would need the host mid-step
    drafter.propose([free, constrained], max_model_len=100)
    assert free.draft_token_ids == [PLACEHOLDER] * 3 and constrained.draft_token_ids == []
