"""Adaptive verification, with capacities decided on the device: lossless greedy output, exact logprobs in every mode, chunked verification
equal to unchunked, and the output distribution by chi-square."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_tiny_checkpoint
from test_spec_decode import PROMPT16, assert_same_logprobs, exact_two_token_distribution, repetitive_prompts
from test_verify import chi_square
from verispec import LLM, SamplingParams
from verispec.outputs import LogprobsTensors
from verispec.spec_decode import verify as verify_mod

# A CPU-like forward: a token costs 2% of a one-token step up to 64 tokens, ten times that past
# them. Budgets land strictly between "verify nothing" and "verify everything" at every batch size
# tested, so the device really chooses.
COST = [[1, 1.0], [64, 2.3], [256, 22.0]]


# ------------------------------------------------------------------------------ the engine
def adaptive(spec: dict, **extra) -> dict:
    return dict(spec, num_speculative_tokens=6, adaptive_verification=True, cost_table=COST, **extra)


def drafters(draft_path: str) -> dict[str, dict]:
    return {
        "ngram": adaptive({"method": "ngram", "prompt_lookup_min": 1}),
        "layer_skip": adaptive({"method": "layer_skip", "num_layers": 1}),
        "draft_model": adaptive({"method": "draft_model", "model": draft_path}),
    }


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory, tiny_llama):
    """A draft model that agrees with tiny_llama often but not always: the target's own weights
    for the first layer, so its q is informative."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("near") / "d", "llama", num_hidden_layers=1)


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama):
    prompts = repetitive_prompts(32, seed=50)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return prompts, params, LLM(tiny_llama, max_num_seqs=32).generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("drafter", ["ngram", "layer_skip", "draft_model"])
def test_greedy_output_equals_non_speculative(tiny_llama, near_draft, greedy_reference, drafter, batch):
    prompts, params, base = greedy_reference
    llm = LLM(tiny_llama, max_num_seqs=32, speculative_config=drafters(near_draft)[drafter])
    out = llm.generate(prompts[:batch], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base[:batch]]
    stats = llm.stats()
    hist = stats["adaptive"]["capacity_histogram"]
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    # Every verifying request-step is in the histogram, and its drafts add up to what was admitted.
    assert sum(c * n for c, n in enumerate(hist)) == stats["adaptive"]["admitted_total"] == stats["num_draft_tokens"]
    assert sum(hist) == stats["num_drafts"]


MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def mixed_params(max_tokens: int = 32) -> list[SamplingParams]:
    """One batch, every mode at once (modes are per request), with processors that change the
    processed scores: the rows of different requests must not be mixed up."""
    out = []
    for i, mode in enumerate(MODES * 2):
        extra = [{}, {"top_k": 5}, {"top_p": 0.8, "top_k": 9}, {"logit_bias": {3: 2.0, 7: -1.5}}][i % 4]
        lp = {"logprob_token_ids": [1, 2, 3]} if i == 3 else {"logprobs": 1 + i % 4}
        out.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs_mode=mode,
                                  **extra, **lp))
    return out


def capture_layouts(monkeypatch) -> list[list[int]]:
    """Records each verify step's per-request capacities (read after the step, in the test): the
    device's admission (model drafters), or the drafts the host's trim left (ngram)."""
    seen: list[torch.Tensor] = []
    original = verify_mod.verify

    def recording(model, hidden, meta, *rest):
        out = original(model, hidden, meta, *rest)
        seen.append(out.num_verified if out.num_verified is not None else torch.tensor(meta.num_draft_tokens))
        return out

    import verispec.worker.runner as runner_mod

    monkeypatch.setattr(runner_mod, "verify", recording)
    return seen


@pytest.mark.parametrize("drafter", ["ngram", "layer_skip", "draft_model"])
def test_logprobs_in_every_mode_equal_non_speculative(tiny_llama, near_draft, drafter, monkeypatch):
    prompts = repetitive_prompts(8, seed=60)
    params = mixed_params()
    base = LLM(tiny_llama).generate(prompts, params, use_tqdm=False)
    layouts = capture_layouts(monkeypatch)
    out = LLM(tiny_llama, speculative_config=drafters(near_draft)[drafter]).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    assert_same_logprobs(base, out)
    for o in out:  # every emitted token in its own dict, ranked (custom ids are unranked extras)
        for tok, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
            assert tok in entry and entry[tok].rank >= 1
    # The host's uniform placeholder (the same number of rows for every request) is not the
    # layout: some step verified different numbers of drafts for different requests.
    assert any(len(set(c.tolist())) > 1 for c in layouts)


def test_a_uniform_placeholder_layout_would_misassign_rows(tiny_llama, near_draft, monkeypatch):
    """Control: slicing the logprob rows by a uniform placeholder instead of the device boundaries
    hands requests each other's rows, and the comparison above catches it."""
    prompts = repetitive_prompts(8, seed=60)
    params = mixed_params()
    base = LLM(tiny_llama).generate(prompts, params, use_tqdm=False)
    original = LogprobsTensors.tolists

    def placeholder(self):
        lists = original(self)
        if lists.cu_num_generated_tokens is not None:
            cu = lists.cu_num_generated_tokens
            r, n = len(cu) - 1, cu[-1]
            lists.cu_num_generated_tokens = [round(i * n / r) for i in range(r + 1)]
        return lists

    monkeypatch.setattr(LogprobsTensors, "tolists", placeholder)
    llm = LLM(tiny_llama, speculative_config=drafters(near_draft)["layer_skip"])
    with pytest.raises((AssertionError, IndexError)):  # wrong rows, or a request short of rows
        assert_same_logprobs(base, llm.generate(prompts, params, use_tqdm=False))


def test_seeded_random_output_with_ngram_equals_non_speculative(small_vocab_model):
    """One-hot drafts: the emitted token at every position is plain sampling's, whatever the
    device admitted, so seeded random requests keep their tokens and logprobs."""
    path = small_vocab_model[0]  # every prompt token is followed by 0: drafts often accepted
    prompts = [PROMPT16[i:] for i in range(0, 12, 2)]
    params = [SamplingParams(temperature=0.7, top_k=8, seed=90 + i, max_tokens=32, ignore_eos=True, logprobs=2,
                             logprobs_mode=MODES[i % 4]) for i in range(6)]
    base = LLM(path).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, speculative_config=adaptive({"method": "ngram", "prompt_lookup_min": 1}))
    out = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    assert_same_logprobs(base, out)


@pytest.mark.parametrize("drafter", ["ngram", "layer_skip"])
def test_chunked_verification_equals_unchunked(tiny_llama, near_draft, drafter):
    prompts = repetitive_prompts(8, seed=80)
    params = mixed_params()
    spec = drafters(near_draft)[drafter]
    whole = LLM(tiny_llama, speculative_config=spec).generate(prompts, params, use_tqdm=False)
    for rows in (1, 3, 7):
        llm = LLM(tiny_llama, speculative_config=dict(spec, max_verify_rows_per_chunk=rows))
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in whole]
        for a, b in zip(whole, out):
            for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert ea.keys() == eb.keys()
                assert all(ea[t].rank == eb[t].rank for t in ea)
                assert max(abs(ea[t].logprob - eb[t].logprob) for t in ea) <= 1e-5
        assert llm.stats()["adaptive"]["admitted_total"] > 0


@pytest.mark.parametrize("spec", ["ngram", "layer_skip", "draft_model"])
def test_adaptive_distribution_matches_target(small_vocab_model, other_draft, spec):
    """Random sampling with capacities chosen on the device still emits exactly p."""
    path, model = small_vocab_model
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    # All 256 requests of a wave prefill in one step and verify together in the next: a cost
    # flat up to their 256 decode tokens and steep past 320 admits some drafts, not all.
    cost = [[1, 1.0], [256, 1.0], [320, 1.1], [512, 2.5]]
    cfg = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2},
        "draft_model": {"method": "draft_model", "model": other_draft, "num_speculative_tokens": 2},
    }[spec]
    llm = LLM(path, max_num_seqs=256, max_num_batched_tokens=8192, seed=123,
              speculative_config=dict(cfg, adaptive_verification=True, cost_table=cost))
    n = 3000
    counts: dict[tuple[int, int], int] = {}
    for o in llm.generate([PROMPT16] * n, params, use_tqdm=False):
        key = tuple(o.outputs[0].token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    stats = llm.stats()["adaptive"]
    assert 0 < stats["admitted_total"] < n  # some second tokens verified a draft, some did not
    stat, df = chi_square(counts, exact_two_token_distribution(model, PROMPT16, params), n)
    assert stat < df + 10 * math.sqrt(2 * df), (stat, df)


def test_stats_without_adaptive_have_no_adaptive_section(tiny_llama):
    llm = LLM(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert "adaptive" not in llm.stats()


@pytest.mark.parametrize("bad, field", [
    ({"adaptive_verification": "yes"}, "adaptive_verification"),
    ({"max_verify_rows_per_chunk": 0}, "max_verify_rows_per_chunk"),
    ({"cost_table": [[0, 1.0]]}, "cost_table"),
    ({"cost_table": []}, "cost_table"),
])
def test_invalid_adaptive_options_name_the_field(tiny_llama, bad, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_llama, speculative_config={"method": "ngram", **bad})




@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_request_that_turns_to_repeating_text_drafts_again_within_32_tokens(method):
    """The bundled model told to copy a list writes it in its own casing (drafts from the prompt
    miss), then falls into repeating itself. Rows cost three tenths of a step, so drafts that
    miss are refused; the refused drafts are checked against what the request writes (and
    probed), so verification resumes within 32 tokens of the turn, where every draft lands."""
    items = "apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum, melon, kiwi, lime, fig, date, guava"
    cost = [[1, 0.010], [2, 0.013], [4, 0.019], [8, 0.031]]
    llm = LLM(speculative_config={"method": method, "num_speculative_tokens": 5, "adaptive_verification": True,
                                  "cost_table": cost})
    verified: list[tuple[int, int, int]] = []  # (tokens written before the step, verified, accepted)
    observe = llm.engine.drafts.observe

    def recorded(entry, record):
        verified.append((entry.request.num_output_tokens, record.num_verified, record.num_accepted))
        observe(entry, record)

    llm.engine.drafts.observe = recorded
    msgs = [{"role": "user", "content": f"Introduce yourself in one sentence, then copy the following text exactly: {items}"}]
    out = llm.chat([msgs], SamplingParams(temperature=0, max_tokens=120), use_tqdm=False)[0]
    llm.shutdown()
    ids, prompt = list(out.outputs[0].token_ids), list(out.prompt_token_ids)

    def repeats(i: int, n: int = 8) -> bool:  # the next n tokens were written before, in the prompt or the answer
        window, before = ids[i : i + n], prompt + ids[: i + n - 1]
        return len(window) == n and any(before[j : j + n] == window for j in range(len(before) - n))

    turn = next(i for i in range(len(ids)) if repeats(i))
    assert turn >= 24  # an opening that copies nothing: the drafts there miss
    assert sum(a for at, _, a in verified if at < turn - 12) <= 2 and sum(v for at, v, _ in verified if at < turn - 12) <= 6
    landed = [at for at, _, a in verified if a and at >= turn]
    assert landed and landed[0] <= turn + 32
    after = [(v, a) for at, v, a in verified if at >= turn + 32]
    assert sum(a for _, a in after) >= 0.9 * sum(v for v, _ in after) > 0  # and keeps drafting where they land
