"""The output types (verispec/outputs.py): the device-side `LogprobsTensors` (chunks concatenate to
the unchunked scores, host lists slice by the device's request boundaries), its host twin
`LogprobsLists`, and `RequestOutput.to_dict`, each against values built by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import score_rows
from test_logprobs import MODES
from verispec.outputs import CompletionOutput, Logprob, LogprobsLists, LogprobsTensors, RequestOutput


def _random_tensors(rows: int, k: int, seed: int, mode: str) -> LogprobsTensors:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 64, generator=g) * 3
    sampled = torch.randint(0, 64, (rows,), generator=g)
    return score_rows(logits, k, sampled, as_logprobs=mode.endswith("logprobs"))



@pytest.mark.parametrize("mode", MODES)
def test_cat_of_chunks_equals_unchunked(mode):
    g = torch.Generator().manual_seed(16)
    logits = torch.randn(10, 64, generator=g) * 3
    sampled = torch.randint(0, 64, (10,), generator=g)
    as_lp = mode.endswith("logprobs")
    whole = score_rows(logits, 5, sampled, as_logprobs=as_lp)
    parts = [score_rows(logits[a:b], 5, sampled[a:b], as_logprobs=as_lp) for a, b in ((0, 3), (3, 10))]
    joined = LogprobsTensors.cat(parts)
    assert torch.equal(joined.logprob_token_ids, whole.logprob_token_ids)
    assert torch.equal(joined.logprobs, whole.logprobs)
    assert torch.equal(joined.selected_token_ranks, whole.selected_token_ranks)
    parts[0].cu_num_generated_tokens = torch.tensor([0, 3])
    with pytest.raises(ValueError):  # boundaries belong to the whole, not to a chunk of rows
        LogprobsTensors.cat(parts)



def test_tolists_slices_by_the_device_boundaries():
    t = _random_tensors(9, 3, 17, "raw_logprobs")
    # Requests own 2, 4 and 3 rows; a uniform layout of 3 each would be wrong.
    t.cu_num_generated_tokens = torch.tensor([0, 2, 6, 9])
    lists = t.tolists()
    assert lists.cu_num_generated_tokens == [0, 2, 6, 9]
    assert isinstance(lists, LogprobsLists)
    for i, (a, b) in enumerate([(0, 2), (2, 6), (6, 9)]):
        part = lists.slice_request(i)
        assert (part.logprobs == t.logprobs[a:b].numpy()).all()
        assert (part.logprob_token_ids == t.logprob_token_ids[a:b].numpy()).all()
    assert lists.slice_request(1, 1).logprobs.shape[0] == 1  # only the emitted rows



def test_cat_pads_narrower_chunks_with_minus_inf_and_minus_one():
    wide = LogprobsTensors(torch.tensor([[1, 2, 3]]), torch.tensor([[-0.1, -1.0, -2.0]]), torch.tensor([1]))
    narrow = LogprobsTensors(torch.tensor([[4]]), torch.tensor([[-0.5]]), torch.tensor([2]))
    joined = LogprobsTensors.cat([wide, narrow])
    assert joined.logprob_token_ids.tolist() == [[1, 2, 3], [4, -1, -1]]
    assert joined.logprobs[1, 1:].isneginf().all() and joined.selected_token_ranks.tolist() == [1, 2]


def test_lists_cat_keeps_the_narrowest_width():
    # Cached prompt rows may carry more alternatives than this request asked for.
    a = LogprobsLists(np.zeros((2, 4), np.int64), np.zeros((2, 4), np.float32), np.ones(2, np.int64))
    b = LogprobsLists(np.ones((1, 2), np.int64), np.ones((1, 2), np.float32), np.ones(1, np.int64))
    joined = LogprobsLists.cat([a, b])
    assert joined.logprobs.shape == (3, 2) and len(joined) == 3
    assert joined.logprob_token_ids[2].tolist() == [1, 1]


def test_lists_without_boundaries_refuse_to_slice_a_request():
    lists = LogprobsLists(np.zeros((2, 1), np.int64), np.zeros((2, 1), np.float32), np.ones(2, np.int64))
    with pytest.raises(ValueError, match="no request boundaries"):
        lists.slice_request(0)


def test_to_dict_is_plain_data_with_string_token_keys():
    comp = CompletionOutput(0, "hi", [5], -0.5, [{5: Logprob(-0.5, 1, "hi")}], finish_reason="stop")
    out = RequestOutput("r", "p", [1], [None, {1: Logprob(-2.0)}], [comp], True).to_dict()
    assert out["outputs"][0]["logprobs"] == [{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "hi"}}]
    assert out["prompt_logprobs"][1] == {"1": {"logprob": -2.0, "rank": None, "decoded_token": None}}
    assert out["finished"] is True and out["error"] is None


def test_token_sources_name_a_steps_accepted_drafts_then_the_targets_token():
    from verispec.outputs import TOKEN_SOURCE_KINDS, token_sources

    assert [s.kind for s in token_sources(1, 0, 0, 7)] == ["sampled"]
    assert [s.kind for s in token_sources(3, 4, 2, 7)] == ["accepted", "accepted", "recovered"]
    assert [s.kind for s in token_sources(4, 3, 3, 7)] == ["accepted"] * 3 + ["bonus"]
    assert [s.kind for s in token_sources(1, 2, 0, 7)] == ["recovered"]  # the first draft was rejected
    assert {s.step for s in token_sources(4, 3, 3, 7)} == {7}
    assert set(TOKEN_SOURCE_KINDS) == {"sampled", "accepted", "recovered", "bonus"}
    assert {s.drafts for s in token_sources(3, 4, 2, 7)} == {4}
