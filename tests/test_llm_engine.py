"""The engine end to end against HF generate: greedy token for token, under batching, chunked
prefill and preemption; seeded determinism; aborts and block accounting."""

from __future__ import annotations

import pytest

import faults
from conftest import assert_greedy_matches_hf, hf_greedy, hf_model, random_prompts
from verispec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints):
    return {arch: hf_model(path) for arch, path in tiny_checkpoints.items()}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_batch_matches_hf(tiny_checkpoints, hf_models, arch):
    prompts = random_prompts(8, 3, 60, seed=3)
    # A 32-token budget forces the long prompts through several prefill chunks while others decode.
    llm = LLM(tiny_checkpoints[arch], max_num_batched_tokens=32, block_size=4)
    ours = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    expected = [hf_greedy(hf_models[arch], p, GREEDY.max_tokens) for p in prompts]
    assert ours == expected
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_greedy_under_preemption_matches_hf(tiny_llama, hf_models):
    prompts = random_prompts(8, 10, 40, seed=4)
    # 24 blocks of 4 tokens cannot hold 8 sequences of up to 64 tokens: requests get preempted
    # and recomputed, and must still produce exactly the same tokens.
    llm = LLM(tiny_llama, max_num_batched_tokens=48, block_size=4, num_kv_blocks=24)
    ours = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.stats()["num_preemptions"] > 0
    assert ours == [hf_greedy(hf_models["llama"], p, GREEDY.max_tokens) for p in prompts]
    assert llm.stats()["kv_blocks_free"] == 24


def test_seeded_request_is_independent_of_batch(tiny_llama):
    llm = LLM(tiny_llama, max_num_batched_tokens=64)
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = random_prompts(1, 12, 12, seed=5)[0]
    alone = llm.generate([prompt], target, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(16, 3, 50, seed=6)
    noise = [SamplingParams(temperature=1.0, max_tokens=20 + i, ignore_eos=True) for i in range(16)]
    batch = llm.generate(others[:7] + [prompt] + others[7:], noise[:7] + [target] + noise[7:], use_tqdm=False)
    assert batch[7].outputs[0].token_ids == alone
    # Unseeded requests are not all identical copies of each other.
    assert len({tuple(o.outputs[0].token_ids[:5]) for o in batch}) > 8


def test_different_seeds_differ_and_same_seed_repeats(tiny_llama):
    llm = LLM(tiny_llama)
    prompt = [5, 6, 7, 8]
    draw = lambda seed: llm.generate(  # noqa: E731
        [prompt], SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].token_ids
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_n_samples(tiny_llama):
    llm = LLM(tiny_llama)
    out = llm.generate([[5, 6, 7]], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out[0].outputs)


def test_abort_returns_all_blocks(tiny_llama):
    llm = LLM(tiny_llama, block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    total = engine.pool.num_blocks
    for i, p in enumerate(random_prompts(6, 20, 40, seed=8)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(6):  # some mid-prefill, some decoding
        engine.step()
    assert engine.pool.num_free_blocks < total
    for i in range(6):
        engine.abort_request(f"r{i}")
    assert engine.pool.num_free_blocks == total
    assert not engine.has_unfinished_requests()


def test_stop_token_ids_and_max_tokens(tiny_llama):
    llm = LLM(tiny_llama)
    free = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[5]
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    first = free.index(stop_at)
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_min_tokens_suppresses_eos(tiny_llama):
    llm = LLM(tiny_llama)
    # Make EOS (id 2) overwhelmingly likely; min_tokens must still hold it back.
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=5, logit_bias={2: 100.0})
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == 2 and len(out.token_ids) == 6 and out.finish_reason == "stop"


def test_prompt_validation(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 70))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[1, 100000]), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 10**6]], GREEDY, use_tqdm=False)
    # Nothing is left behind by the rejected batches.
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_pool_too_small_for_request_is_a_clear_error(tiny_llama):
    llm = LLM(tiny_llama, block_size=4, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=20), use_tqdm=False)


def test_unknown_engine_option_values(tiny_llama):
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_llama, dtype="float8")
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(tiny_llama, logprobs_mode="raw_logrobs")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(tiny_llama, max_num_seqs=0)


@pytest.mark.slow
def test_smollm2_greedy_batch_matches_hf(smollm2_llm, smollm2_hf):
    tok = smollm2_llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "Write a haiku about autumn leaves.",
        "def fibonacci(n):",
        "List three uses of copper:",
        "Translate to French: The cat sleeps on the warm windowsill all afternoon.",
        "Q: What is the boiling point of water at sea level?\nA:",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "Summarize: The meeting covered budgets, hiring plans and the new office move.",
    ]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # The fixture's 64-token budget and 256-block pool chunk the longer prompts.
    ours = token_ids(smollm2_llm.generate(prompts, params, use_tqdm=False))
    expected = [hf_greedy(smollm2_hf, p, 24) for p in prompts]
    assert_greedy_matches_hf(smollm2_hf, prompts, ours, expected)


@pytest.mark.slow
def test_smollm2_text_and_chat(smollm2_llm):
    out = smollm2_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    stop = smollm2_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16, stop=["."]), use_tqdm=False)[0]
    assert stop.outputs[0].finish_reason == "stop" and stop.outputs[0].stop_reason == "."
    assert "." not in stop.outputs[0].text
    chat = smollm2_llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "4" in chat.outputs[0].text


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_a_failing_request_does_not_sink_the_batch(tiny_llama, spec):
    """A model error that only one request triggers fails that request; the rest of the batch
    finishes with the output it has when run without the faulty request."""
    prompts = random_prompts(5, 6, 20, seed=5)
    poison = 511
    prompts = [[t for t in p if t != poison] for p in prompts]
    bad = prompts[2][:3] + [poison] + prompts[2][3:]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True, logprobs=2)] * 3
    llm = LLM(tiny_llama, max_num_batched_tokens=48, speculative_config=spec)
    clean = llm.generate([p for i, p in enumerate(prompts) if i != 2],
                         [q for i, q in enumerate(params[:5]) if i != 2], use_tqdm=False)
    faults.install(llm.engine.runner, [poison])
    outs = llm.generate(prompts[:2] + [bad] + prompts[3:], params[:5], use_tqdm=False)
    assert outs[2].error is not None and "injected fault" in outs[2].error
    assert outs[2].outputs[0].finish_reason == "abort"
    for out, ref in zip(outs[:2] + outs[3:], clean):
        assert out.error is None
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    # The engine keeps serving afterwards.
    again = llm.generate(prompts[0], params[0], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == clean[0].outputs[0].token_ids


def test_a_group_reaches_every_child(tiny_llama):
    engine = LLM(tiny_llama).engine
    two = SamplingParams(n=2, temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("r", [5, 6, 7], two, group="client-1")
    engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=2), group="client-1")
    engine.add_request("t", [5, 6, 7], two)  # no group: its own
    groups = {r.request_id: r.group for r in engine.scheduler.waiting}
    assert groups == {"r#0": "client-1", "r#1": "client-1", "s": "client-1", "t#0": "t", "t#1": "t"}
    while engine.has_unfinished_requests():
        engine.step()


def test_a_fair_share_preemption_keeps_every_output(tiny_llama):
    llm = LLM(tiny_llama, max_num_seqs=4, block_size=4)
    prompts = random_prompts(6, 5, 20, seed=9)
    expected = token_ids(llm.generate(prompts + [[5, 6, 7]], GREEDY, use_tqdm=False))
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"big-{i}", p, GREEDY, group="big")
    done = {}

    def step():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})

    step()
    step()
    engine.add_request("small", [5, 6, 7], GREEDY)
    step()  # big holds all 4 slots: its latest admitted makes room for small at once
    assert "small" in [r.request_id for r in engine.scheduler.running]
    assert engine.stats()["num_preemptions"] == 1
    while engine.has_unfinished_requests():
        step()
    assert [done[f"big-{i}"] for i in range(6)] + [done["small"]] == expected
