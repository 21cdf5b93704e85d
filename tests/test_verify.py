"""The verifier (spec_decode/verify.py with rejection.py) on hand-built p and q: greedy and random
acceptance, recovery, the bonus token, and the output distribution by chi-square."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from verispec import SamplingParams
from verispec.config import LogprobsMode
from verispec.core.step_types import Drafts, ScheduledRequest
from verispec.core.request import Request
from verispec.sample.metadata import RowSpec
from verispec.sample.noise import RequestNoise
from verispec.spec_decode.metadata import PLACEHOLDER, ModelDrafts, SpecDecodeMetadata
from verispec.spec_decode.verify import verify


# ------------------------------------------------------------------------------ the verifier
class RowsAsLogits:
    """A model stand-in for `verify`: the hidden rows are the logits themselves."""

    @staticmethod
    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def row_spec(params: SamplingParams, output_ids: list[int], noise: RequestNoise | None) -> RowSpec:
    """A row with an empty prompt: it emits sequence position len(output_ids)."""
    return RowSpec(params=params, prompt_ids=[], output_ids=output_ids, noise=noise, stop_ids=frozenset(),
                   mode=LogprobsMode.RAW_LOGPROBS, num_logprobs=None)


def run_verify(logits, drafts, num_drafts, q=None, greedy=False, seed=0):
    """The engine's verifier (`verify`) on hand-built requests with empty prompts: request i's
    candidate rows are logits[i, :num_drafts[i] + 1], row j emitting sequence position j. With q,
    drafts are a model drafter's: q[i, j] is draft j's q, and the host sees only placeholders."""
    params = SamplingParams(temperature=0.0 if greedy else 1.0)
    sampled, first_rows, model_drafts, hidden = [], [], {}, []
    for i, d in enumerate(num_drafts):
        req = Request(f"r{i}", None, [], params, LogprobsMode.RAW_LOGPROBS, RequestNoise(seed + i), frozenset(), 64)
        ids = list(drafts[i][:d])
        if q is not None and d:
            model_drafts[req.request_id] = ModelDrafts(token_ids=torch.tensor(ids),
                                                       probs=q[i, :d], confidence=q[i, :d].amax(-1))
            ids = [PLACEHOLDER] * d
        sampled.append(ScheduledRequest(req, 1, True, Drafts(tuple(ids))))
        first_rows.append(sum(len(x) for x in hidden))
        hidden.append(logits[i, : d + 1])
    meta = SpecDecodeMetadata.build(sampled, first_rows, model_drafts, None, logits.shape[-1], torch.device("cpu"))
    out = verify(RowsAsLogits(), torch.cat(hidden), meta, max_rows=None)
    return SimpleNamespace(sampled=out.sampled, num_sampled=out.num_sampled, num_accepted=out.num_sampled - 1)


def peaked(rows: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits whose argmax per row is the given token, by a wide margin."""
    out = torch.zeros(len(rows), vocab)
    for i, t in enumerate(rows):
        out[i, t] = 20.0
    return out


def test_greedy_perfect_match_emits_drafts_and_bonus():
    out = run_verify(peaked([3, 4, 5, 6])[None], [[3, 4, 5]], [3], greedy=True)
    assert out.sampled.tolist() == [[3, 4, 5, 6]] and out.num_sampled.tolist() == [4]


def test_greedy_early_mismatch_emits_argmax_and_stops():
    out = run_verify(peaked([3, 4, 5, 6])[None], [[3, 7, 5]], [3], greedy=True)
    assert out.sampled.tolist() == [[3, 4, -1, -1]] and out.num_accepted.tolist() == [1]


def test_padding_drafts_are_ignored():
    logits = torch.stack([peaked([3, 4, 5, 6]), peaked([1, 2, 0, 0])])
    out = run_verify(logits, [[3, 4, 5], [1, 0, 0]], [3, 1], greedy=True)
    assert out.sampled.tolist() == [[3, 4, 5, 6], [1, 2, -1, -1]]


def test_zero_drafts_is_plain_sampling():
    """A request without drafts is a request with zero drafts: its one row is sampled as plain
    sampling would sample it, greedy or seeded, next to requests that do verify drafts."""
    from verispec.sample.metadata import SamplingMetadata
    from verispec.sample.sampler import sample

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4, 32, generator=g)
    for greedy in (True, False):
        out = run_verify(logits, [[], [5, 6], [], [1, 2, 3]], [0, 2, 0, 3], greedy=greedy, seed=40)
        for i in (0, 2):
            assert out.num_sampled[i].item() == 1 and out.sampled[i, 1:].tolist() == [-1, -1, -1]
            params = SamplingParams(temperature=0.0 if greedy else 1.0)
            spec = row_spec(params, [], None if greedy else RequestNoise(40 + i))
            plain = sample(logits[i, :1], SamplingMetadata.build([spec], 32, torch.device("cpu")))
            assert out.sampled[i, 0].item() == plain.item()


def test_random_accepts_everything_when_q_equals_p_and_adds_bonus():
    logits = torch.randn(1, 4, 8)
    q = logits[:, :3].softmax(-1)
    drafts = [[int(torch.multinomial(q[0, j], 1)) for j in range(3)]]
    out = run_verify(logits, drafts, [3], q=q)
    assert out.num_accepted.tolist() == [3] and out.sampled[0, :3].tolist() == drafts[0]


def test_zero_q_always_rejects_and_recovers_outside_the_draft():
    logits = torch.zeros(1, 2, 8)
    q = torch.full((1, 1, 8), 1 / 7)
    q[0, 0, 2] = 0.0  # the draft token has no draft mass: reject whatever u is
    for seed in range(20):
        out = run_verify(logits, [[2]], [1], q=q, seed=seed)
        assert out.num_accepted.tolist() == [0]
        # Residual max(p - q, 0) is all on token 2 here (p uniform 1/8 < q elsewhere).
        assert out.sampled[0, 0].item() == 2


def test_one_hot_rejection_never_re_emits_the_draft():
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, 5] = -1.0  # p(5) < 1: sometimes rejected
    for seed in range(50):
        out = run_verify(logits, [[5]], [1], seed=seed)
        if out.num_accepted.item() == 0:
            assert out.sampled[0, 0].item() != 5


def test_seeded_verification_is_deterministic():
    logits = torch.randn(3, 4, 16)
    drafts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    a = run_verify(logits, drafts, [3, 2, 3], seed=5)
    b = run_verify(logits, drafts, [3, 2, 3], seed=5)
    assert torch.equal(a.sampled, b.sampled)


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic over bins with expected >= 5 (the rest merged into one bin)."""
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for key, p in probs.items():
        exp = n * p
        if exp >= 5:
            stat += (counts.get(key, 0) - exp) ** 2 / exp
            df += 1
        else:
            rest_obs += counts.get(key, 0)
            rest_exp += exp
    extra = sum(v for key, v in counts.items() if key not in probs)
    rest_obs += extra
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    elif extra:
        stat = math.inf  # mass where the exact distribution has none
    return stat, max(df, 1)


def passes(counts, probs, n) -> bool:
    stat, df = chi_square(counts, probs, n)
    return stat < df + 10 * math.sqrt(2 * df)


@pytest.mark.parametrize("with_q", [False, True])
def test_verifier_output_distribution_equals_p(with_q):
    """First emitted token over many seeds equals p whatever the draft distribution q."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 6, 6000
    logits = torch.randn(1, 2, vocab, generator=g)
    p = logits[0, 0].softmax(-1)
    q = torch.randn(1, 1, vocab, generator=g).softmax(-1) if with_q else None
    counts: dict[int, int] = {}
    for seed in range(n):
        dg = torch.Generator().manual_seed(10_000 + seed)
        draft = int(torch.multinomial(q[0, 0], 1, generator=dg)) if with_q else 2
        tok = run_verify(logits, [[draft]], [1], q=q, seed=seed).sampled[0, 0].item()
        counts[tok] = counts.get(tok, 0) + 1
    assert passes(counts, {i: p[i].item() for i in range(vocab)}, n)


