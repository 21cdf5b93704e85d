"""Prompt logprobs in bounded chunks of rows (sample/prompt_logprobs.py): the chunking changes nothing,
and the rows' cache key is what decides them."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.config import LogprobsMode
from verispec.sample.metadata import RowSpec
from verispec.sample.prompt_logprobs import prompt_rows_key, score_prompt_rows


@pytest.mark.parametrize("mode", list(LogprobsMode))
def test_any_chunk_size_gives_the_rows_of_one_chunk(mode):
    g = torch.Generator().manual_seed(3)
    vocab, n = 40, 11
    weight = torch.randn(vocab, 8, generator=g)
    hidden, targets = torch.randn(n, 8, generator=g), torch.randint(0, vocab, (n,), generator=g)
    params = SamplingParams(temperature=0.7, top_k=9, logit_bias={3: 1.5})
    spec = RowSpec(params=params, prompt_ids=[], output_ids=[], noise=None, stop_ids=frozenset(), mode=mode,
                   num_logprobs=3, position_independent=True)
    # One matrix-vector product a row: a row's logits never depend on the rows computed beside it
    # (a BLAS matmul's may, by the row count: not what this test is about).
    def logits(h):
        return torch.stack([weight @ row for row in h])

    whole = score_prompt_rows(logits, hidden, targets, spec, vocab, chunk_rows=n)
    assert torch.equal(whole.logprob_token_ids[:, 0], targets)  # column 0: the actual next prompt token
    for rows in (1, 3, 4):
        part = score_prompt_rows(logits, hidden, targets, spec, vocab, chunk_rows=rows)
        assert torch.equal(part.logprob_token_ids, whole.logprob_token_ids)
        assert torch.equal(part.logprobs, whole.logprobs)
        assert torch.equal(part.selected_token_ranks, whole.selected_token_ranks)


def test_the_key_holds_what_decides_the_rows_and_nothing_else():
    raw = LogprobsMode.RAW_LOGPROBS
    processed = LogprobsMode.PROCESSED_LOGPROBS
    a, b = SamplingParams(temperature=0.5, top_k=5, seed=1), SamplingParams(temperature=0.5, top_k=5, seed=2, max_tokens=3)
    assert prompt_rows_key(a, raw) == prompt_rows_key(SamplingParams(temperature=1.3), raw)  # raw: mode alone
    assert prompt_rows_key(a, processed) == prompt_rows_key(b, processed)  # seed, length: no effect
    assert prompt_rows_key(a, processed) != prompt_rows_key(SamplingParams(temperature=0.5, top_k=6), processed)
