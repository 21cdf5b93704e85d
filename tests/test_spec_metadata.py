"""SpecDecodeMetadata: the layout of a step's drafts and candidate rows, built from host values and
device drafts, and the placeholders that model drafts replace."""

from __future__ import annotations

import pytest
import torch

from verispec.config import LogprobsMode
from verispec.core.request import Request
from verispec.core.step_types import Drafts, ScheduledRequest
from verispec.sample.noise import RequestNoise
from verispec.sampling_params import SamplingParams
from verispec.spec_decode.metadata import PLACEHOLDER, ModelDrafts, SpecDecodeMetadata

CPU = torch.device("cpu")
VOCAB = 16


def request(rid: str, prompt: list[int], params: SamplingParams | None = None) -> Request:
    return Request(rid, None, prompt, params or SamplingParams(temperature=0), LogprobsMode.RAW_LOGPROBS,
                   RequestNoise(rid), frozenset(), 32)


def model_drafts(ids: list[int]) -> ModelDrafts:
    probs = torch.full((len(ids), VOCAB), 1.0 / VOCAB)
    return ModelDrafts(token_ids=torch.tensor(ids), probs=probs,
                       confidence=probs.amax(-1))


def test_layout_of_plain_host_and_device_drafts():
    """Three sampled requests: no drafts, host drafts (ngram) and device drafts (a model drafter),
    laid out as 1, 3 and 4 candidate rows; the device values replace the placeholders."""
    a, b, c = request("a", [1, 2]), request("b", [3]), request("c", [4, 5, 6])
    sampled = [ScheduledRequest(a, 1, True), ScheduledRequest(b, 1, True, Drafts((7, 8))),
               ScheduledRequest(c, 1, True, Drafts((PLACEHOLDER,) * 3))]
    meta = SpecDecodeMetadata.build(sampled, [0, 1, 4], {"c": model_drafts([9, 10, 11])}, None, VOCAB, CPU)
    assert meta.num_draft_tokens == [0, 2, 3] and len(meta.rows) == 8
    assert meta.host_draft_ids == [[], [7, 8], [-1, -1, -1]]
    assert meta.draft_token_ids.tolist() == [[-1, -1, -1, -1], [7, 8, -1, -1], [9, 10, 11, -1]]
    # Candidate row j of a request sees its drafts 1..j in its history and emits position p + j.
    assert [r.output_ids for r in meta.rows[1:4]] == [[], [7], [7, 8]]
    assert [r.position for r in meta.rows[4:]] == [3, 4, 5, 6]
    assert meta.scoring is None and meta.survival is None  # nobody asked for logprobs; no plan
    assert meta.draws.sample_u is None and meta.sampling.temperature is None  # all greedy: nothing to draw
    # The flat batch holds c's placeholders at rows 5..7; the device drafts replace them.
    ids = torch.tensor([2, 3, 7, 8, 6, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER])
    meta.write_drafts(ids)
    assert ids.tolist() == [2, 3, 7, 8, 6, 9, 10, 11]


def test_a_placeholder_is_not_a_token():
    """A placeholder that reached the model unreplaced must fail loudly, not read a real token."""
    embed = torch.nn.Embedding(VOCAB, 4)
    with pytest.raises(IndexError):
        embed(torch.tensor([3, PLACEHOLDER]))


def test_q_draws_only_on_the_draft_rows_of_random_requests():
    """accept / recover noise is drawn for a q-draft's own rows only: not for the bonus row, not
    for a greedy request, not for one-hot drafts."""
    hot, greedy, ngram = (request("r", [1], SamplingParams(temperature=1.0, seed=1)), request("g", [1]),
                          request("n", [1], SamplingParams(temperature=1.0, seed=2)))
    sampled = [ScheduledRequest(hot, 1, True, Drafts((PLACEHOLDER,) * 2)), ScheduledRequest(greedy, 1, True, Drafts((PLACEHOLDER,))),
               ScheduledRequest(ngram, 1, True, Drafts((5,)))]
    drafts = {"r": model_drafts([3, 4]), "g": model_drafts([6])}
    meta = SpecDecodeMetadata.build(sampled, [0, 3, 5], drafts, None, VOCAB, CPU)
    assert meta.draws.uses_q.tolist() == [True, True, False, False, False, False, False]
    assert meta.draws.greedy.tolist() == [False, False, False, True, True, False, False]
    assert (meta.draws.accept_u[2:] == 1.0).all() and (meta.draws.accept_u[:2] < 1.0).all()
    assert (meta.draws.q[2:] == 0).all() and torch.allclose(meta.draws.q[:2].sum(-1), torch.ones(2))
    assert (meta.draws.sample_u[3:5] == 1.0).all()  # greedy rows never draw


def test_a_host_drafters_q_stays_sparse_with_empty_rows_elsewhere():
    """Suffix decoding's q (token ids, probabilities per draft) becomes a SparseQ over every
    candidate row: its draft rows carry their pairs, its bonus row and the other requests' rows
    none. Beside a model drafter's dense q (one engine never has both) it is scattered densely."""
    from verispec.spec_decode.rejection import SparseQ

    hot, ngram = request("h", [1], SamplingParams(temperature=1.0, seed=1)), request("n", [1], SamplingParams(temperature=1.0, seed=2))
    q_pairs = (([3, 9], [0.75, 0.25]), ([4], [1.0]))
    sampled = [ScheduledRequest(hot, 1, True, Drafts((3, 4), q_pairs)), ScheduledRequest(ngram, 1, True, Drafts((5,)))]
    meta = SpecDecodeMetadata.build(sampled, [0, 3], {}, None, VOCAB, CPU)
    q = meta.draws.q
    assert isinstance(q, SparseQ) and q.ids.shape == (5, 2)
    assert q.dense(VOCAB)[0, [3, 9]].tolist() == [0.75, 0.25] and q.dense(VOCAB)[1, 4].item() == 1.0
    assert (q.dense(VOCAB)[2:] == 0).all()  # the bonus row and the one-hot request
    assert meta.draws.uses_q.tolist() == [True, True, False, False, False]
    model = request("m", [1], SamplingParams(temperature=1.0, seed=3))
    sampled.append(ScheduledRequest(model, 1, True, Drafts((PLACEHOLDER,))))
    mixed = SpecDecodeMetadata.build(sampled, [0, 3, 5], {"m": model_drafts([6])}, None, VOCAB, CPU).draws.q
    assert torch.equal(mixed[:5], q.dense(VOCAB)) and torch.allclose(mixed[5], torch.full((VOCAB,), 1.0 / VOCAB))
