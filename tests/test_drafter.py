"""Drafters' host side (spec_decode/drafter.py): what prompt lookup proposes at the end of a step,
within each request's room, and the placeholders of model drafters."""

from __future__ import annotations

from test_scheduler import make_request
from verispec.config import SpeculativeConfig
from verispec.core.step_types import Drafts
from verispec.spec_decode.drafter import ModelDrafter, NgramDrafter
from verispec.spec_decode.metadata import PLACEHOLDER


def decoding(rid: str, prompt: list[int], max_tokens: int = 100, pending: int = 1):
    """A request whose prompt is computed and whose one new token (`pending`) waits for the next step."""
    req = make_request(rid, 1)
    req.prompt_token_ids, req.token_ids, req.max_tokens = prompt, prompt + [pending], max_tokens
    req.num_computed_tokens = len(prompt)
    return req


def test_prompt_lookup_proposes_from_the_requests_own_tokens():
    drafter = NgramDrafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    repeat, fresh = decoding("r", [4, 5, 6, 7, 4, 5, 6, 7], pending=4), decoding("f", [20, 21, 22, 23], pending=24)
    proposed = drafter.propose([repeat, fresh], [3, 3])
    assert proposed["r"].token_ids == (5, 6, 7) and proposed["f"].token_ids == ()
    assert drafter.propose([repeat], [2])["r"].token_ids == (5, 6)  # within the room the policy gives
    assert drafter.propose([repeat], [0]) == {}


def test_model_drafters_reserve_placeholders_except_for_constrained_requests():
    drafter = ModelDrafter()
    free, constrained = decoding("a", [1, 2, 3]), decoding("b", [1, 2, 3])
    constrained.grammar = object()  # its drafts would need the host mid-step
    assert drafter.propose([free, constrained], [3, 3]) == {"a": Drafts((PLACEHOLDER,) * 3)}
