"""The sampler (verispec/sample/sampler.py): greedy rows take the argmax; random rows are drawn by the
inverse-CDF draw, checked against the processed distribution by chi-square, never on a masked
token, and the same for a seeded row alone or anywhere in a batch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_processors import CPU, NEG_INF, make_row
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.noise import RequestNoise
from verispec.sample.processors import apply_processors
from verispec.sample.sampler import CDF_BLOCK, inverse_cdf, sample
from verispec.sampling_params import SamplingParams


def test_greedy_rows_take_argmax():
    vocab = 500
    rng = torch.Generator().manual_seed(9)
    logits = torch.randn(6, vocab, generator=rng)
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(3)]
    rows += [make_row(SamplingParams(temperature=1.0), noise=RequestNoise(i)) for i in range(3)]
    md = SamplingMetadata.build(rows, vocab, CPU)
    tokens = sample(apply_processors(logits, md), md)
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert torch.equal(tokens[:3], logits[:3].argmax(dim=-1))



def test_seeded_rows_are_batch_invariant():
    vocab = 64
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(10))
    target = SamplingParams(temperature=1.5, seed=0)
    drawn_alone, drawn_batched = [], []
    for seed in range(30):
        alone_rows = [make_row(target, noise=RequestNoise(seed))]
        md = SamplingMetadata.build(alone_rows, vocab, CPU)
        drawn_alone.append(int(sample(apply_processors(logits, md), md)[0]))

        # Same request at index 2 of a batch with greedy, unseeded and differently-seeded rows.
        torch.manual_seed(1000 + seed)
        others = torch.randn(4, vocab)
        batch_logits = torch.cat([others[:2], logits, others[2:]])
        rows = [
            make_row(SamplingParams(temperature=0.0)),
            make_row(SamplingParams(temperature=0.8, top_k=5), noise=None),
            make_row(target, noise=RequestNoise(seed)),
            make_row(SamplingParams(temperature=1.0), noise=RequestNoise(seed + 1)),
            make_row(SamplingParams(top_p=0.5), noise=RequestNoise(77)),
        ]
        md = SamplingMetadata.build(rows, vocab, CPU)
        drawn_batched.append(int(sample(apply_processors(batch_logits, md), md)[2]))
    assert drawn_alone == drawn_batched
    assert len(set(drawn_alone)) > 5  # really random, not argmax



def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    nz = probs > 0
    n = counts.sum().item()
    expected = probs[nz] * n
    stat = (((counts[nz] - expected) ** 2) / expected).sum().item()
    return stat, int(nz.sum().item()) - 1



@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6)])
def test_sample_matches_distribution_chi_square(params):
    vocab, draws = 8, 20000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, NEG_INF, 1.5, -1.0])  # token 5 masked
    rows = [make_row(params, noise=RequestNoise(i)) for i in range(draws)]
    md = SamplingMetadata.build(rows, vocab, CPU)
    processed = apply_processors(base.expand(draws, vocab).contiguous(), md)
    tokens = sample(processed, md)
    probs = processed[0].double().softmax(-1)
    assert probs[5] == 0
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0, f"masked tokens were drawn: {counts.tolist()}"
    stat, df = _chi_square(counts, probs)
    assert stat < df + 10 * math.sqrt(2 * df), (stat, df, counts.tolist(), probs.tolist())



def test_sample_never_draws_masked_tokens():
    vocab = 100
    rng = torch.Generator().manual_seed(12)
    rows = [
        make_row(SamplingParams(temperature=2.0, top_k=3), noise=RequestNoise(i))
        for i in range(500)
    ] + [
        make_row(SamplingParams(temperature=2.0, allowed_token_ids=[4, 9]), noise=RequestNoise(i))
        for i in range(500)
    ]
    logits = torch.randn(len(rows), vocab, generator=rng)
    md = SamplingMetadata.build(rows, vocab, CPU)
    processed = apply_processors(logits, md)
    tokens = sample(processed, md)
    assert torch.isfinite(processed.gather(1, tokens[:, None])).all()
    assert set(tokens[500:].tolist()) <= {4, 9}



def test_an_all_greedy_batch_draws_no_noise(monkeypatch):
    # Greedy rows never touch the random stream: the noise function must not even be called.
    import verispec.sample.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "uniform_values", lambda *a: (_ for _ in ()).throw(AssertionError("noise drawn")))
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    md = SamplingMetadata.build([make_row(SamplingParams(temperature=0.0)) for _ in range(4)], 32, CPU)
    assert torch.equal(sample(logits, md), logits.argmax(-1))


def _flat_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The definition: the first column whose float64 cumulative sum exceeds u times the total."""
    cdf = weights.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_max(weights.shape[1] - 1)


@pytest.mark.parametrize("vocab", [49152, 50000, 3 * CDF_BLOCK + 1, 100])
def test_the_two_level_draw_is_the_flat_inverse_cdf(vocab):
    """Blocks of CDF_BLOCK columns, a short last block, one block: the draws are the definition's,
    but for a draw within a float32 part sum's rounding (about 4e-7 of a part) of a boundary."""
    gen = torch.Generator().manual_seed(vocab)
    weights = (torch.randn(64, vocab, generator=gen) * 4).softmax(dim=-1)
    weights[weights < 1e-6] = 0.0
    weights[::3, CDF_BLOCK:2 * CDF_BLOCK] = 0.0  # whole blocks without mass
    draws = differ = 0
    for _ in range(40):
        u = torch.rand(64, generator=gen, dtype=torch.float64)
        got, want = inverse_cdf(weights, u), _flat_inverse_cdf(weights, u)
        assert (weights.gather(1, got[:, None]) > 0).all()
        draws, differ = draws + 64, differ + int((got != want).sum())
    assert differ <= 1, (differ, draws)


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 3 * CDF_BLOCK), nonzero=st.lists(st.integers(0, 3 * CDF_BLOCK - 1), min_size=1, max_size=5),
       u=st.sampled_from([2.0**-53, 1e-9, 0.5, 1 - 1e-9, 1 - 2.0**-53]), scale=st.sampled_from([1e-30, 1e-6, 1.0]))
def test_a_column_without_weight_is_never_drawn(vocab, nonzero, u, scale):
    weights = torch.zeros(1, vocab)
    for i in nonzero:
        weights[0, i % vocab] = scale * (1 + i % 7)
    got = int(inverse_cdf(weights, torch.tensor([u], dtype=torch.float64))[0])
    assert weights[0, got] > 0
