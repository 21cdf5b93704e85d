"""Per-step sampling metadata (verispec/sample/metadata.py): which stages a batch runs is decided on
the host from the rows' parameters (a stage no row uses has no tensor), the per-row values each
stage gets, a row's position and noise key, and `select`'s gathered views, all against values
written by hand."""

from __future__ import annotations

import torch

from test_processors import CPU, make_row
from verispec.config import LogprobsMode
from verispec.core.request import Request
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.noise import RequestNoise
from verispec.sampling_params import SamplingParams

VOCAB = 50


def test_defaults_run_no_stage():
    md = SamplingMetadata.build([make_row(SamplingParams()), make_row(SamplingParams(temperature=0))], VOCAB, CPU)
    assert (md.temperature, md.top_k, md.top_p, md.min_p, md.grammar) == (None, None, None, None, None)
    assert not md.any_penalty and not md.any_sparse and md.greedy == [False, True]


def test_a_stage_one_row_uses_gets_every_rows_value():
    rows = [make_row(SamplingParams(temperature=0)), make_row(SamplingParams(temperature=0.5, top_k=7)),
            make_row(SamplingParams(top_k=10**6, top_p=0.9, min_p=0.1))]
    md = SamplingMetadata.build(rows, VOCAB, CPU)
    assert md.temperature.tolist() == [1.0, 0.5, 1.0]  # greedy rows divide by 1
    assert md.top_k.tolist() == [VOCAB, 7, VOCAB]  # off, and above the vocabulary, is the whole vocabulary
    assert torch.allclose(md.top_p, torch.tensor([1.0, 1.0, 0.9])) and torch.allclose(md.min_p, torch.tensor([0, 0, 0.1]))


def test_penalties_and_history_stages_skip_position_independent_rows():
    pen = SamplingParams(repetition_penalty=1.2, min_tokens=3)
    assert SamplingMetadata.build([make_row(pen)], VOCAB, CPU).any_penalty
    prompt_row = SamplingMetadata.build([make_row(pen, position_independent=True)], VOCAB, CPU)
    assert not prompt_row.any_penalty and not prompt_row.any_sparse
    # min_tokens stops counting once reached; a logit bias applies to any row.
    assert not SamplingMetadata.build([make_row(pen, output=[1, 2, 3])], VOCAB, CPU).any_sparse
    bias = make_row(SamplingParams(logit_bias={3: 1.0}), position_independent=True)
    assert SamplingMetadata.build([bias], VOCAB, CPU).any_sparse


def test_position_and_noise_key_follow_the_emitted_token():
    noise = RequestNoise(4)
    row = make_row(SamplingParams(temperature=1.0), prompt=[1, 2], output=[3], noise=noise)
    assert row.position == 3 and row.noise_key() == noise.key("sample", 3)
    assert row.noise_key("accept") == noise.key("accept", 3) != row.noise_key()
    assert make_row(SamplingParams(temperature=0), noise=noise).noise_key() is None  # greedy never draws
    assert make_row(SamplingParams(temperature=1.0)).noise_key() is None  # a scoring row has no noise


def test_a_requests_row_counts_its_drafts_and_hides_the_device_tail():
    req = Request("r", None, [1, 2], SamplingParams(logprobs=2), LogprobsMode.RAW_LOGPROBS, RequestNoise(1),
                  frozenset({0}), 10)
    req.token_ids += [5]
    row = req.row(drafts=[-1, -1], purpose="draft", device_tail=torch.tensor([7, 8]))
    assert row.output_ids == [5, -1, -1] and row.host_output_ids() == [5]
    assert (row.position, row.num_logprobs, row.purpose, row.stop_ids) == (5, 2, "draft", frozenset({0}))


def test_select_gathers_each_stage_for_the_picked_rows():
    rows = [make_row(SamplingParams(temperature=t, top_k=k)) for t, k in ((0.5, 3), (0.7, 0), (0.9, 5))]
    md = SamplingMetadata.build(rows, VOCAB, CPU)
    view = md.select(torch.tensor([2, 2, 0]))
    assert torch.allclose(view.temperature, torch.tensor([0.9, 0.9, 0.5]))
    assert view.top_k.tolist() == [5, 5, 3] and view.top_p is None and view.rows is md.rows
    assert view.row_index.tolist() == [2, 2, 0] and md.row_index is None
