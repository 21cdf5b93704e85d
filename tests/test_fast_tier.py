"""The precision tiers end to end: how dtype / quantization resolve, the fast tier's fidelity bar
against the HF fp32 oracle, and exactness *within* a tier (speculative output equals plain
output, logprobs come from the tier's own distribution)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.fidelity import KL_BAR, TOP1_BAR, measure, measure_prompt_rows, verispec_logprobs
from conftest import random_prompts
from verispec import LLM, SamplingParams
from verispec.models.loader import resolve_precision
from verispec.models.quant import QuantizedWeight

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# Within one tier a row's logits do not depend on how many rows share its step (int4 kernels
# and row-wise decode attention are batch-invariant), so speculative and plain logprobs are
# expected to agree to the last bit; 1e-3 is the bound.
WITHIN_TIER_LOGPROB_TOL = 1e-3


def test_auto_resolves_from_the_checkpoint(smollm2_path, tiny_llama):
    assert resolve_precision(smollm2_path, None, None) == (torch.bfloat16, "gguf")
    assert resolve_precision(smollm2_path, torch.float32, None) == (torch.float32, None)
    # fp32 on the GGUF codes, decoded exactly inside the matmul: still the exact tier.
    assert resolve_precision(smollm2_path, torch.float32, "gguf") == (torch.float32, "gguf")
    assert resolve_precision(tiny_llama, None, None) == (torch.float32, None)  # its config.json says float32
    assert resolve_precision(tiny_llama, None, "int4") == (torch.bfloat16, "int4")


@pytest.mark.parametrize("kwargs, field", [
    ({"quantization": "gguf"}, "quantization='gguf' needs a .gguf"),
    ({"quantization": "int3"}, "quantization must be"),
    ({"quantization": "int4", "dtype": "float32"}, "computes in bfloat16"),
    ({"dtype": "float8"}, "dtype must be one of"),
])
def test_bad_precision_options_name_the_field(tiny_llama, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_llama, **kwargs)


def test_int4_keeps_layers_at_4_bits_and_the_embedding_at_8(tiny_llama):
    from verispec.models.loader import load_checkpoint

    _, weights = load_checkpoint(tiny_llama, torch.bfloat16, "int4")
    assert weights["layers.0.q"].bits == 4 and weights["layers.0.down"].bits == 4
    assert isinstance(weights["embed"], QuantizedWeight) and weights["embed"].bits == 8
    assert weights["norm"].dtype == torch.bfloat16


@pytest.fixture(scope="module")
def fast_llm():
    """The default tier with room for a 630-token prompt in one chunk (past the int4 kernels'
    64-row limit, the dense prefill path)."""
    llm = LLM(dtype="auto", num_kv_blocks=128)
    assert llm.engine.config.quantization == "gguf"
    return llm


def top1_allowance(tokens: int) -> float:
    """The top-1 bar less three binomial standard deviations of a sample of `tokens`."""
    return TOP1_BAR - 3 * (TOP1_BAR * (1 - TOP1_BAR) / tokens) ** 0.5


@pytest.mark.slow
def test_fast_tier_meets_the_fidelity_bar_on_a_sample(smollm2_hf, fast_llm):
    """The bar (mean KL <= 2e-3 nats, top-1 >= 97 %) is set over 16 prompts x 128 tokens, which
    the benchmark measures; this sample of ~250 tokens keeps the KL bar and widens the top-1
    allowance by three binomial standard deviations (sqrt(0.97 * 0.03 / 250) ~ 1.1 %)."""
    from benchmarks.prompts import chat_prompts

    prompts = [p.ids for p in chat_prompts(fast_llm.get_tokenizer(), 8)]
    fid = measure(smollm2_hf, fast_llm.engine.model, prompts, 32)
    print(f"fast tier vs HF fp32 over {fid.tokens} tokens: mean KL {fid.mean_kl:.2e}, top-1 {fid.top1:.1%}, "
          f"max |logprob diff| {fid.max_logprob_diff:.3f}")
    assert fid.tokens >= 200
    assert fid.mean_kl <= KL_BAR
    assert fid.top1 >= top1_allowance(fid.tokens)


def long_prompts(tokenizer) -> list[list[int]]:
    from benchmarks.prompts import extractive_prompt, long_prompt

    prompts = [long_prompt(tokenizer, 150).ids, long_prompt(tokenizer, 400).ids, extractive_prompt(tokenizer).ids]
    assert min(map(len, prompts)) > 2 * 64  # every prompt well past the kernels' row limit
    return prompts


@pytest.mark.slow
def test_fast_tier_meets_the_fidelity_bar_on_long_prompts(smollm2_hf, fast_llm):
    """Every row of three prompts of 150 to 630 tokens, each in one chunk, as an evaluator scores
    them (the dense prefill path, and the int4 layout it decodes), then 16 decode rows after each
    (the kernels, over that prefill's KV cache), pooled, against HF fp32."""
    prompts = long_prompts(fast_llm.get_tokenizer())
    rows = measure_prompt_rows(smollm2_hf, fast_llm.engine.model, prompts)
    decode = measure(smollm2_hf, fast_llm.engine.model, prompts, 16)
    fid = rows.pooled(decode)
    print(f"fast tier vs HF fp32: {rows.tokens} prompt rows, mean KL {rows.mean_kl:.2e}, top-1 {rows.top1:.1%}; "
          f"{decode.tokens} decode rows, mean KL {decode.mean_kl:.2e}, top-1 {decode.top1:.1%}; "
          f"max |logprob diff| {fid.max_logprob_diff:.3f}")
    assert rows.tokens >= 1000 and decode.tokens >= 40
    assert fid.mean_kl <= KL_BAR
    assert fid.top1 >= top1_allowance(fid.tokens)


# The fast tier's logits differ from fp32 by bf16 rounding through the stack (2^-8 relative, on
# logits up to |31|, measured up to 0.44 nats on a logprob): a split between the tiers' greedy
# outputs is legitimate only where the exact tier's top two lie closer than that.
TIER_SPLIT_GAP = 0.5


@pytest.mark.slow
def test_default_tier_greedy_follows_the_exact_tier_on_long_prompts(smollm2_llm, fast_llm):
    prompts = long_prompts(fast_llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    fast = fast_llm.generate(prompts, params, use_tqdm=False)
    exact = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for f, e in zip(fast, exact):
        got, want = f.outputs[0].token_ids, e.outputs[0].token_ids
        j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if j is None:
            continue
        top = e.outputs[0].logprobs[j]
        assert got[j] in top, f"the fast tier chose token {got[j]} at {j}, outside the exact tier's top 2"
        gap = top[want[j]].logprob - top[got[j]].logprob
        assert gap <= TIER_SPLIT_GAP, f"the tiers split at token {j} with an exact-tier gap of {gap:.3f}"


def assert_same_output(base, spec) -> float:
    """Identical greedy ids; returns the largest logprob difference, asserted within tolerance."""
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    gap = 0.0
    for a, b in zip(base, spec):
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert ea.keys() == eb.keys()
            gap = max(gap, max(abs(ea[t].logprob - eb[t].logprob) for t in ea))
    assert gap <= WITHIN_TIER_LOGPROB_TOL
    return gap




@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("spec", [
    NGRAM,
    {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2},
    dict(NGRAM, adaptive_verification=True, cost_table=[[1, 1.0], [64, 1.2]]),
])
def test_speculative_equals_plain_within_the_quantized_tier(tiny_llama, quantization, spec):
    prompts = random_prompts(4, 8, 40, seed=21)
    prompts = [p + p[:12] for p in prompts]  # repeats give prompt lookup something to find
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    kw = dict(quantization=quantization, max_num_batched_tokens=64)
    base = LLM(tiny_llama, **kw).generate(prompts, params, use_tqdm=False)
    out = LLM(tiny_llama, speculative_config=spec, **kw).generate(prompts, params, use_tqdm=False)
    gap = assert_same_output(base, out)
    print(f"{quantization} {spec['method']}: max |logprob spec - plain| = {gap:.2e}")


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_speculative_equals_plain_when_verify_steps_pass_the_kernels_rows(tiny_llama, quantization):
    """48 requests verifying k = 5 drafts make steps of up to 288 rows, past the 64 rows after
    which long prefill chunks take the dense path; decode and verify rows stay on the kernel (and
    the head takes any number of rows), so the output still equals plain decoding's."""
    prompts = random_prompts(48, 8, 30, seed=5)
    prompts = [p + p[:10] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    kw = dict(quantization=quantization, max_num_batched_tokens=2048)
    base = LLM(tiny_llama, **kw).generate(prompts, params, use_tqdm=False)
    spec = dict(NGRAM, num_speculative_tokens=5)
    llm = LLM(tiny_llama, speculative_config=spec, **kw)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_drafts"] > 0
    assert assert_same_output(base, out) == 0.0


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_quantized_tier_logprobs_come_from_its_own_distribution(tiny_llama, mode):
    """Greedy decode in the int4 tier: each emitted token is the argmax of the tier's own
    distribution, and its reported score is that distribution's (teacher-forced through the
    same model, one token per step, as the engine decodes)."""
    llm = LLM(tiny_llama, quantization="int4", logprobs_mode=mode)
    prompt = random_prompts(1, 20, 20, seed=22)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    ref = verispec_logprobs(llm.engine.model, prompt, tokens)  # [12, vocab] log-softmax
    assert tokens == ref.argmax(-1).tolist()
    for row, tok, entry in zip(ref, tokens, out.outputs[0].logprobs):
        got = entry[tok].logprob
        if mode.endswith("logprobs"):
            assert abs(got - float(row[tok])) <= WITHIN_TIER_LOGPROB_TOL
        else:  # logits: the same distribution up to its normaliser
            assert abs(got - max(v.logprob for v in entry.values())) <= WITHIN_TIER_LOGPROB_TOL
        assert entry[tok].rank == 1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)


@pytest.mark.slow
def test_smollm2_fast_tier_speculative_equals_plain():
    tok_prompt = "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. " * 3
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    base = LLM(num_kv_blocks=64).generate([tok_prompt], params, use_tqdm=False)
    spec_llm = LLM(num_kv_blocks=64, speculative_config=NGRAM)
    out = spec_llm.generate([tok_prompt], params, use_tqdm=False)
    assert spec_llm.engine.config.quantization == "gguf"
    assert spec_llm.stats()["num_accepted_tokens"] > 0
    gap = assert_same_output(base, out)
    print(f"SmolLM2 fast tier: max |logprob spec - plain| = {gap:.2e}")
