"""The logits processor chain and logprob scoring, against independent references (the sampler:
test_sampler.py).

The reference for repetition penalty, temperature, min_p, top_k and top_p is transformers' own
logits processors/warpers, applied per row in the engine's order.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from conftest import hf_processed, score_rows
from verispec.config import LogprobsMode
from verispec.sample.logprobs import LSE_CHUNK, streaming_logsumexp
from verispec.sample.metadata import RowSpec, SamplingMetadata
from verispec.sample.processors import apply_processors
from verispec.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def make_row(params, prompt=(), output=(), noise=None, stop_ids=(), position_independent=False,
             bad_words_token_ids=()) -> RowSpec:
    return RowSpec(
        params=params,
        prompt_ids=list(prompt),
        output_ids=list(output),
        noise=noise,
        stop_ids=frozenset(stop_ids),
        mode=LogprobsMode.PROCESSED_LOGPROBS,
        num_logprobs=None,
        position_independent=position_independent,
        bad_words_token_ids=[list(w) for w in bad_words_token_ids],
    )


def run_chain(logits: torch.Tensor, rows: list[RowSpec]) -> torch.Tensor:
    md = SamplingMetadata.build(rows, logits.shape[1], CPU)
    return apply_processors(logits, md)


def assert_same_masked_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """-inf positions identical, finite entries within tol."""
    assert actual.shape == expected.shape
    assert actual.dtype == torch.float32
    a_inf, e_inf = torch.isneginf(actual), torch.isneginf(expected)
    assert torch.equal(a_inf, e_inf), f"-inf masks differ at {torch.nonzero(a_inf != e_inf)[:10].tolist()}"
    assert torch.isfinite(actual[~a_inf]).all()
    torch.testing.assert_close(actual[~a_inf], expected[~e_inf], atol=tol, rtol=tol)


# ---------------------------------------------------------------- HF reference
def hf_reference_row(logits_row: torch.Tensor, row: RowSpec) -> torch.Tensor:
    """One row through transformers' processors, in the engine's order (stages 5-8)."""
    return hf_processed(logits_row, row.params, row.prompt_ids + row.output_ids)


def mixed_batch_rows(vocab: int, rng: torch.Generator) -> list[RowSpec]:
    def hist(n):
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    prompt, output = hist(30), hist(12)
    output = output + output[:4]  # repeated tokens
    return [
        make_row(SamplingParams(temperature=0.0)),  # greedy: temperature treated as 1
        make_row(SamplingParams(temperature=0.7, top_k=20)),  # top_k only
        make_row(SamplingParams(temperature=1.3, top_p=0.8)),  # top_p only
        make_row(SamplingParams(temperature=0.9, min_p=0.1)),  # min_p only
        make_row(  # combined, with repetition penalty over prompt + output
            SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
            prompt=prompt, output=output,
        ),
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=hist(20), output=hist(5)),
        make_row(SamplingParams(temperature=1.0, top_k=1)),  # top_k=1 keeps only the argmax
        make_row(SamplingParams(temperature=1.1, repetition_penalty=0.8, top_p=0.5), prompt=prompt, output=output),
    ]


@pytest.mark.parametrize("seed", range(4))
def test_chain_matches_transformers_processors(seed):
    vocab = 1000
    rng = torch.Generator().manual_seed(seed)
    rows = mixed_batch_rows(vocab, rng)
    logits = torch.randn(len(rows), vocab, generator=rng) * 2.0
    raw = logits.clone()
    out = run_chain(logits, rows)
    assert torch.equal(logits, raw), "apply_processors modified its input"
    expected = torch.stack([hf_reference_row(logits[i], r) for i, r in enumerate(rows)])
    assert_same_masked_close(out, expected)
    # Sanity: the stages really did something, so the comparison is not vacuous.
    assert torch.isneginf(out[1]).sum() == vocab - 20
    assert 0 < torch.isneginf(out[2]).sum() < vocab
    assert 0 < torch.isneginf(out[3]).sum() < vocab
    assert torch.isfinite(out[6]).sum() == 1 and out[6].argmax() == logits[6].argmax()
    assert not torch.isneginf(out[0]).any()
    torch.testing.assert_close(out[0], logits[0], atol=0, rtol=0)  # greedy, no processors: raw


def test_each_row_processed_alone_equals_in_batch():
    vocab = 1000
    rng = torch.Generator().manual_seed(7)
    rows = mixed_batch_rows(vocab, rng)
    logits = torch.randn(len(rows), vocab, generator=rng) * 2.0
    batched = run_chain(logits, rows)
    for i, r in enumerate(rows):
        alone = run_chain(logits[i : i + 1], [r])
        assert_same_masked_close(batched[i : i + 1], alone, tol=1e-6)


def test_top_p_off_row_is_batch_invariant_at_low_temperature():
    vocab = 1000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 3.0
    cold = make_row(SamplingParams(temperature=0.02))  # top_p off; many probs underflow in fp32
    other = make_row(SamplingParams(top_p=0.9))
    alone = run_chain(logits[:1], [cold])
    batched = run_chain(logits, [cold, other])
    assert not torch.isneginf(alone).any()
    assert_same_masked_close(batched[:1], alone, tol=1e-6)


def test_bfloat16_input_not_modified_and_upcast():
    vocab = 300
    logits = (torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    raw = logits.clone()
    rows = [make_row(SamplingParams(temperature=0.5, top_k=10)), make_row(SamplingParams(temperature=0))]
    out = run_chain(logits, rows)
    assert torch.equal(logits, raw) and logits.dtype == torch.bfloat16
    expected = torch.stack([hf_reference_row(logits[i].float(), r) for i, r in enumerate(rows)])
    assert_same_masked_close(out, expected)


def test_all_defaults_is_identity_copy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    out = run_chain(logits, [make_row(SamplingParams()) for _ in range(3)])
    assert torch.equal(out, logits)
    out.add_(1.0)
    assert not torch.equal(out, logits), "output aliases the raw input"


# ---------------------------------------------------------------- presence / frequency
def test_presence_frequency_penalty_match_hand_reference():
    vocab = 200
    rng = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, vocab, (40,), generator=rng).tolist()
    output = [3, 3, 3, 9, 9, 17, 150, 3]
    rows = [
        make_row(SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), prompt=prompt, output=output),
        make_row(SamplingParams(presence_penalty=-1.5, frequency_penalty=0.0), prompt=prompt, output=output),
        make_row(SamplingParams(presence_penalty=0.0, frequency_penalty=-2.0), prompt=prompt, output=output),
        make_row(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), prompt=prompt, output=[]),
        make_row(SamplingParams(), prompt=prompt, output=output),  # no penalty in a penalised batch
        make_row(  # repetition (prompt+output) then presence/frequency (output only)
            SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.25),
            prompt=prompt, output=output,
        ),
    ]
    logits = torch.randn(len(rows), vocab, generator=rng) * 2
    out = run_chain(logits, rows)
    expected = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            expected[i] = hf_reference_row(logits[i], r)
        counts = torch.zeros(vocab)
        for t in r.output_ids:
            counts[t] += 1
        expected[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    assert_same_masked_close(out, expected)
    # Prompt-only tokens are untouched by presence/frequency.
    prompt_only = sorted(set(prompt) - set(output))
    torch.testing.assert_close(out[0, prompt_only], logits[0, prompt_only], atol=0, rtol=0)
    torch.testing.assert_close(out[3], logits[3], atol=0, rtol=0)


# ---------------------------------------------------------------- sparse stages
def test_logit_bias_adds_to_listed_ids_only():
    vocab = 100
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(2))
    bias = {0: 100.0, 5: -100.0, 42: 0.5, 99: -3}
    out = run_chain(logits, [make_row(SamplingParams(logit_bias=bias)), make_row(SamplingParams())])
    expected = logits.clone()
    for k, v in bias.items():
        expected[0, k] += v
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_allowed_token_ids_mask_everything_else():
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    allowed = [1, 7, 50, 99]
    rows = [
        make_row(SamplingParams(allowed_token_ids=allowed)),
        make_row(SamplingParams()),
        # A bias on a disallowed id must not resurrect it.
        make_row(SamplingParams(allowed_token_ids=allowed, logit_bias={2: 100.0, 7: 1.0})),
    ]
    out = run_chain(logits, rows)
    mask = torch.ones(vocab, dtype=torch.bool)
    mask[allowed] = False
    assert torch.isneginf(out[0, mask]).all()
    torch.testing.assert_close(out[0, allowed], logits[0, allowed], atol=0, rtol=0)
    torch.testing.assert_close(out[1], logits[1], atol=0, rtol=0)
    assert torch.isneginf(out[2, mask]).all()
    assert out[2, 7] == pytest.approx(logits[2, 7].item() + 1.0, abs=1e-6)


def test_min_tokens_masks_stop_ids_until_reached():
    vocab = 64
    stop = {2, 10}
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(min_tokens=3)
    rows = [
        make_row(p, prompt=[1], output=[], stop_ids=stop),
        make_row(p, prompt=[1], output=[4, 5], stop_ids=stop),
        make_row(p, prompt=[1], output=[4, 5, 6], stop_ids=stop),  # reached: no masking
        make_row(p, prompt=[1], output=[4, 5, 6, 7], stop_ids=stop),
    ]
    out = run_chain(logits, rows)
    others = [t for t in range(vocab) if t not in stop]
    for i in (0, 1):
        assert torch.isneginf(out[i, sorted(stop)]).all()
        torch.testing.assert_close(out[i, others], logits[i, others], atol=0, rtol=0)
    for i in (2, 3):
        torch.testing.assert_close(out[i], logits[i], atol=0, rtol=0)


def test_bad_words_single_and_multi_token():
    vocab = 32
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(6))

    # The rows carry the request's bad words as token sequences, which the engine tokenizes.
    p = SamplingParams(bad_words=["five", "seven eight"])
    outputs = [[], [7], [1, 7], [7, 1], [8, 7, 9]]
    out = run_chain(logits, [make_row(p, prompt=[7], output=o, bad_words_token_ids=[[5], [7, 8]]) for o in outputs])
    for i, o in enumerate(outputs):
        banned = {5} | ({8} if o and o[-1] == 7 else set())
        keep = [t for t in range(vocab) if t not in banned]
        assert torch.isneginf(out[i, sorted(banned)]).all(), (i, o)
        torch.testing.assert_close(out[i, keep], logits[i, keep], atol=0, rtol=0)


@pytest.mark.parametrize("on_device", [0, 1, 2, 3, 4])
def test_a_device_tail_reads_as_the_host_values_would(on_device):
    """A model's drafts are placeholders on the host and values on the device: penalties and bad
    words that reach into them give the logits the host values give."""
    vocab = 32
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(9)) * 3
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25,
                       bad_words=["a", "b c", "d e f"])
    bad = [[5], [7, 8], [1, 7, 9]]
    outputs = [[1, 7], [3, 1, 7], [7, 7, 1, 7], [2, 3, 4, 1], [1, 1, 7, 7], [9, 1, 7, 1]]
    host = [make_row(p, prompt=[2, 4], output=o, bad_words_token_ids=bad) for o in outputs]
    mixed = []
    for o in outputs:
        n = min(on_device, len(o))
        row = make_row(p, prompt=[2, 4], output=o[: len(o) - n] + [-1] * n, bad_words_token_ids=bad)
        row.device_tail = torch.tensor(o[len(o) - n :]) if n else None
        mixed.append(row)
    expected = run_chain(logits, host)
    assert torch.isneginf(expected).sum() > len(outputs)  # some multi-token bad words apply
    torch.testing.assert_close(run_chain(logits, mixed), expected, atol=0, rtol=0)


def test_position_independent_rows_skip_history_stages():
    """Prompt rows: allowed ids, logit_bias, temperature, min_p, top-k/top-p only."""
    vocab = 100
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(8)) * 2
    p = SamplingParams(
        temperature=0.5, top_k=30, repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0,
        min_tokens=5, logit_bias={3: 2.0}, bad_words=["x"],
    )
    history = list(range(10, 40))
    row = make_row(p, prompt=history, output=history[:5], stop_ids={2}, position_independent=True,
                   bad_words_token_ids=[[4]])
    out = run_chain(logits[:1], [row])
    biased = logits[:1].clone()
    biased[0, 3] += 2.0
    expected = TopKLogitsWarper(30)(None, TemperatureLogitsWarper(0.5)(None, biased))
    assert_same_masked_close(out, expected)


# ---------------------------------------------------------------- logprob scores
def test_scorer_fp32():
    rng = torch.Generator().manual_seed(13)
    scores = torch.randn(5, 1000, generator=rng) * 3
    selected = torch.randint(0, 1000, (5,), generator=rng)
    selected[0] = scores[0].argmax()
    k = 7
    res = score_rows(scores, k, selected)
    ref = torch.log_softmax(scores, dim=-1)
    top_vals, top_ids = torch.topk(scores, k, dim=-1)
    assert res.logprob_token_ids.shape == (5, k + 1)
    assert torch.equal(res.logprob_token_ids[:, 0], selected)
    assert torch.equal(res.logprob_token_ids[:, 1:], top_ids)
    assert res.logprobs.dtype == torch.float32
    torch.testing.assert_close(res.logprobs, ref.gather(1, res.logprob_token_ids), atol=1e-6, rtol=0)
    expected_ranks = (scores >= scores.gather(1, selected[:, None])).sum(-1)
    assert torch.equal(res.selected_token_ranks, expected_ranks)
    assert res.selected_token_ranks[0] == 1
    # Rank computed on the logprobs is the same.
    assert torch.equal(expected_ranks, (ref >= ref.gather(1, selected[:, None])).sum(-1))


def test_scorer_custom_ids_and_logits_mode():
    rng = torch.Generator().manual_seed(14)
    scores = torch.randn(4, 300, generator=rng)
    selected = torch.randint(0, 300, (4,), generator=rng)
    custom = torch.randint(0, 300, (4, 5), generator=rng)
    res = score_rows(scores, 0, selected, custom_ids=custom)
    assert torch.equal(res.logprob_token_ids, torch.cat([selected[:, None], custom], 1))
    torch.testing.assert_close(
        res.logprobs, torch.log_softmax(scores, -1).gather(1, res.logprob_token_ids), atol=1e-6, rtol=0
    )
    raw = score_rows(scores, 3, selected, as_logprobs=False)
    torch.testing.assert_close(raw.logprobs, scores.gather(1, raw.logprob_token_ids), atol=0, rtol=0)
    assert torch.equal(raw.logprob_token_ids[:, 1:], scores.topk(3, -1).indices)
    # num_topk=0, no custom ids: only the selected column.
    only = score_rows(scores, 0, selected)
    assert only.logprob_token_ids.shape == (4, 1) and only.logprobs.shape == (4, 1)
    # num_topk above the vocabulary is clamped.
    assert score_rows(scores, 10_000, selected).logprob_token_ids.shape == (4, 301)


def test_scorer_masked_processed_logits():
    scores = torch.randn(2, 50, generator=torch.Generator().manual_seed(15))
    scores[:, 10:] = NEG_INF
    selected = torch.tensor([3, 12])  # row 1 selects a masked entry
    res = score_rows(scores, 3, selected)
    ref = torch.log_softmax(scores, -1)
    torch.testing.assert_close(res.logprobs, ref.gather(1, res.logprob_token_ids), atol=1e-6, rtol=0)
    assert res.selected_token_ranks[1] == 50  # everything is >= -inf


def test_scorer_bfloat16():
    rng = torch.Generator().manual_seed(16)
    full = torch.randn(4, 2000, generator=rng) * 3
    scores = full.bfloat16()
    selected = torch.randint(0, 2000, (4,), generator=rng)
    k = 5
    res = score_rows(scores, k, selected)
    assert res.logprobs.dtype == torch.float32
    ids = res.logprob_token_ids
    # Exact arithmetic on the bf16 values (fp32 accumulation, no bf16 rounding of the result).
    exact = torch.log_softmax(scores.float(), -1)
    torch.testing.assert_close(res.logprobs, exact.gather(1, ids), atol=1e-5, rtol=0)
    # Against the fp32 model output: within bf16 rounding of the logits (|x| < ~15, 2^-9 relative).
    fp32_ref = torch.log_softmax(full, -1)
    torch.testing.assert_close(res.logprobs, fp32_ref.gather(1, ids), atol=5e-2, rtol=0)
    # Top-k values are the true top-k values (ids may differ among bf16 ties).
    torch.testing.assert_close(res.logprobs[:, 1:], exact.topk(k, -1).values, atol=1e-5, rtol=0)
    expected_ranks = (scores >= scores.gather(1, selected[:, None])).sum(-1)
    assert torch.equal(res.selected_token_ranks, expected_ranks)


def test_streaming_logsumexp_large_vocab():
    vocab = 50_000
    assert vocab > 2 * LSE_CHUNK
    rng = torch.Generator().manual_seed(17)
    x = torch.randn(5, vocab, generator=rng) * 4
    x[1] += 1e4  # large offset: must not overflow
    x[2, ::3] = NEG_INF  # masked entries
    x[3, :] = NEG_INF
    x[3, vocab - 1] = 2.5  # single survivor in the last, partial chunk
    x[4] -= 1e4
    got = streaming_logsumexp(x)
    ref = torch.logsumexp(x.double(), dim=-1).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    assert got[3] == pytest.approx(2.5, abs=1e-6)
    # bf16 input accumulates in fp32.
    xb = torch.randn(2, vocab, generator=rng).bfloat16()
    torch.testing.assert_close(
        streaming_logsumexp(xb), torch.logsumexp(xb.double(), -1).float(), atol=1e-5, rtol=1e-6
    )


def test_streaming_logsumexp_all_masked_row_is_neg_inf():
    x = torch.full((2, 10), NEG_INF)
    x[1, 3] = 0.0
    got = streaming_logsumexp(x)
    assert torch.isneginf(got[0]) and not torch.isnan(got).any()
    assert got[1] == 0.0
