"""Suffix decoding (spec_decode/suffix.py): what the drafter proposes and from whose tokens, the
cache's bounds, and, end to end, greedy output and logprobs equal to plain decoding (the output
distribution under the q rule: test_spec_decode.py's chi-square)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_drafter import decoding
from test_spec_decode import assert_same_logprobs, repetitive_prompts, run_with_and_without
from verispec import LLM, SamplingParams
from verispec.config import SpeculativeConfig
from verispec.core.request import RequestStatus
from verispec.spec_decode.policy import draft_room
from verispec.spec_decode.suffix import SuffixCache, SuffixDrafter


def suffix_config(**kw) -> SpeculativeConfig:
    cfg = SpeculativeConfig(method="suffix", **kw)
    cfg.validate()
    return cfg


def with_params(req, **kw):
    req.params = replace(req.params, **kw)
    return req


def propose(drafter: SuffixDrafter, reqs) -> dict[str, list[int]]:
    """What the drafter proposes for `reqs`, each with the room the draft policy would give it
    (24 drafts, a context of 100), by request id (absent: no draft); its Drafts in `propose.last`."""
    propose.last = drafter.propose(reqs, [draft_room(r, 24, 100) for r in reqs])
    return {rid: list(d.token_ids) for rid, d in propose.last.items()}


def grow(req, tokens: list[int]) -> None:
    """The request emitted `tokens`: they are in its sequence, all computed but the newest."""
    req.token_ids += tokens
    req.num_computed_tokens = req.num_tokens - 1


def test_defaults_are_vllms():
    cfg = suffix_config()
    assert (cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
            cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    assert SpeculativeConfig(method="ngram").num_speculative_tokens == 3


@pytest.mark.parametrize("field, value", [
    ("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_tree_depth", 65),
    ("suffix_decoding_max_cached_requests", -1), ("suffix_decoding_max_spec_factor", 0.0),
    ("suffix_decoding_min_token_prob", 1.5), ("suffix_decoding_max_cached_tokens", "many"),
    ("num_speculative_tokens", 33),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse({"method": "suffix", field: value})


def test_a_request_drafts_from_its_own_prompt_greedily_with_confidences():
    drafter = SuffixDrafter(suffix_config())
    req = with_params(decoding("r", [4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9, 4, 5], pending=6), temperature=0.0)
    assert propose(drafter, [req])["r"][:4] == [7, 8, 9, 4]
    drafts = propose.last["r"]
    assert drafts.q is None  # greedy: one-hot, the most frequent path
    assert len(drafts.confidence) == len(drafts) and all(0 < c <= 1 for c in drafts.confidence)


def test_a_random_request_draws_with_its_noise_and_carries_q():
    drafter = SuffixDrafter(suffix_config(suffix_decoding_min_token_prob=0.0))
    prompt = [1, 2, 7, 1, 2, 7, 1, 2, 9, 1]
    req = with_params(decoding("r", prompt, pending=2), temperature=1.0, seed=5)
    drawn = propose(drafter, [req])["r"]
    ids, probs = propose.last["r"].q[0]
    assert sorted(zip(ids, probs)) == [(7, 2 / 3), (9, 1 / 3)]
    again = with_params(decoding("s", prompt, pending=2), temperature=1.0, seed=5)
    other = SuffixDrafter(suffix_config(suffix_decoding_min_token_prob=0.0))
    assert propose(other, [again])["s"] == drawn  # keyed noise: the same draw


def test_siblings_draft_from_each_others_tokens_as_soon_as_they_are_emitted():
    drafter = SuffixDrafter(suffix_config())
    prompt = [50, 51, 52, 53]
    first, second = decoding("a#0", prompt, pending=60), decoding("a#1", prompt, pending=60)
    for req in (first, second):
        with_params(req, temperature=0.0)
    propose(drafter, [first, second])
    grow(first, [61, 62, 63, 64, 65])
    assert propose(drafter, [first, second])["a#1"][:5] == [61, 62, 63, 64, 65]  # the sibling's output, one step old


def test_a_salted_request_never_drafts_another_salts_tokens():
    drafter = SuffixDrafter(suffix_config())
    prompt = [50, 51, 52, 53]
    owner = with_params(decoding("owner", prompt, pending=60), temperature=0.0, cache_salt="tenant-a")
    same = with_params(decoding("same", prompt, pending=60), temperature=0.0, cache_salt="tenant-a")
    other = with_params(decoding("other", prompt, pending=60), temperature=0.0, cache_salt="tenant-b")
    plain = with_params(decoding("plain", prompt, pending=60), temperature=0.0)
    grow(owner, [61, 62, 63, 64, 65])
    proposed = propose(drafter, [owner, same, other, plain])
    assert proposed["same"][:5] == [61, 62, 63, 64, 65] and "other" not in proposed and "plain" not in proposed
    owner.status = RequestStatus.FINISHED_STOPPED  # cached after it finishes: still its salt's only
    drafter.finish("owner")
    assert propose(drafter, [other, plain]) == {}
    assert set(drafter.cache.global_trees) == {"tenant-a", "tenant-b", ""}


def test_finished_outputs_stay_cached_and_the_oldest_leave_first():
    cache = SuffixCache(depth=8, max_cached_requests=2, max_cached_tokens=1000)
    reqs = [decoding(f"r{i}", [i, 100 + i], pending=200 + i) for i in range(4)]
    for req in reqs:
        grow(req, [300 + req.token_ids[-1]] * 3)
        cache.sync(req)
        req.status = RequestStatus.FINISHED_STOPPED
        cache.finish(req.request_id)
    stats = cache.stats()
    assert stats.cached_requests == 2 and cache.live == {}
    tree = cache.global_trees[""]
    assert tree.count([100, 200]) == 0 and tree.count([103, 203]) == 1  # r0 left, r3 stayed
    assert stats.cached_tokens == tree.num_tokens == 2 * (2 + 4)  # prompt tail + output each


def test_the_token_bound_evicts_too():
    cache = SuffixCache(depth=4, max_cached_requests=100, max_cached_tokens=20)
    for i in range(10):
        req = decoding(f"r{i}", [1, 2, 3], pending=4)
        grow(req, list(range(10, 15)))
        cache.sync(req)
        cache.finish(req.request_id)
    assert cache.stats().cached_tokens <= 20 and cache.stats().cached_requests == 2
    assert cache.stats().memory_bytes > 0


def test_no_global_tree_when_nothing_is_cached():
    drafter = SuffixDrafter(suffix_config(suffix_decoding_max_cached_requests=0))
    a, b = decoding("a", [5, 6], pending=7), decoding("b", [5, 6], pending=7)
    grow(a, [8, 9, 10])
    assert "b" not in propose(drafter, [a, b]) and drafter.cache.global_trees == {}


# ------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("k", [3, None])
@pytest.mark.parametrize("batch", [1, 8])
def test_suffix_greedy_equals_non_speculative(tiny_llama, k, batch):
    prompts = repetitive_prompts(batch, seed=40 + batch)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = {"method": "suffix", "num_speculative_tokens": k}
    _, _, stats = run_with_and_without(tiny_llama, prompts, params, spec, max_num_batched_tokens=64, block_size=4)
    assert stats["num_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_suffix_logprobs_and_adaptive_equal_non_speculative(tiny_llama):
    prompts = repetitive_prompts(4, seed=31)
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=3, ignore_eos=True, repetition_penalty=r)
              for r in (1.0, 1.2, 1.0, 1.0)]
    for adaptive in (False, True):
        spec = {"method": "suffix", "adaptive_verification": adaptive, "cost_table": [[1, 0.01], [64, 0.02]]}
        base, out, stats = run_with_and_without(tiny_llama, prompts, params, spec)
        assert stats["num_accepted_tokens"] > 0
        assert_same_logprobs(base, out)


def test_n_samples_learn_from_each_other(tiny_llama):
    """n = 8 random samples of one prompt: the drafter's q comes from the siblings, drafts are
    accepted, and a seeded run repeats itself."""
    params = SamplingParams(temperature=0.8, max_tokens=24, n=8, seed=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(tiny_llama, speculative_config={"method": "suffix"})
        runs.append([c.token_ids for c in llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs])
        assert llm.stats()["num_accepted_tokens"] > 0
    assert runs[0] == runs[1]


def test_without_a_compiler_the_engine_refuses_at_start_up(monkeypatch):
    import verispec.spec_decode.suffix as suffix_mod
    from verispec.spec_decode.suffix_tree import SuffixTreeUnavailable

    def unavailable():
        raise SuffixTreeUnavailable("no C++ compiler (install g++)")

    monkeypatch.setattr(suffix_mod, "suffix_tree_module", unavailable)
    with pytest.raises(RuntimeError, match="method 'suffix' needs its C\\+\\+ suffix tree: no C\\+\\+ compiler"):
        SuffixDrafter(suffix_config())


def test_a_step_that_does_not_draft_still_retires_finished_requests(tiny_llama):
    """Adaptive verification asks for drafts only every n-th step after a streak of refusals; the
    requests that finished in between still leave the live set at once, their outputs cached."""
    from verispec.spec_decode.adaptive import REFUSAL_STREAK

    spec = {"method": "suffix", "adaptive_verification": True, "cost_table": [[1, 0.01], [64, 10.0]]}
    llm = LLM(tiny_llama, speculative_config=spec)  # a draft row costs 0.16 s: none ever pays
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm.generate(repetitive_prompts(4, seed=5), params, use_tqdm=False)
    cache = llm.engine.drafts.drafter.cache
    stats = llm.stats()
    assert llm.engine.drafts.adaptive.refused > 2 * REFUSAL_STREAK
    assert stats["num_drafts"] == stats["adaptive"]["probes"]  # none verified but the probes
    assert cache.live == {} and cache.requests == {} and cache.stats().cached_requests == 4
