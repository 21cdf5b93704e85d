"""The bundled SmolLM2 re-quantized to the file types people download (llama.cpp's Q4_K_M rules,
every matrix Q6_K, every matrix Q5_K), end to end against HF transformers fp32 on the same file:
the exact tier on the codes bit for bit with the dequantized model (greedy equal, logprobs within
fp32_tol of HF), the fast tier within its fidelity bar, every kept type packed and named in the
start-up line. SmolLM2's hidden size (576) is not a multiple of 256, so, as llama-quantize does,
its 576-wide rows fall back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0) and its FFN's down
projection (1536 wide) keeps the K-quant: every packed type runs."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.fidelity import KL_BAR, measure
from benchmarks.ggufs import quantized_copy
from conftest import assert_close_to_oracle
from test_fast_tier import top1_allowance
from verispec import LLM, SamplingParams
from verispec.models import cpu_kernels
from verispec.models.linear import PackedLinear, StackedLinear

pytestmark = [pytest.mark.skipif(not cpu_kernels.kernels_wanted(),
                                 reason="verispec's CPU kernels are off here (no C++ compiler, or VERISPEC_CPU_KERNELS=0)")]
SCHEMES = {"Q4_K_M": {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}, "Q6_K": {"Q6_K", "Q8_0"}, "Q5_K": {"Q5_K", "Q5_1"}}


@pytest.fixture(scope="module")
def kquant_files(smollm2_path, tmp_path_factory) -> dict[str, str]:
    from verispec.models.loader import cache_dir

    return {scheme: str(quantized_copy(smollm2_path, scheme, cache_dir() / "test-ggufs")) for scheme in SCHEMES}


def hf_on(path: str):
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_type_is_kept_packed_and_named(kquant_files, scheme):
    llm = LLM(kquant_files[scheme], enforce_eager=True, num_kv_blocks=16)
    model = llm.engine.model
    line = llm.engine.runtime.line()
    assert all(kind in line for kind in SCHEMES[scheme]) and "re-quantized" not in line, line
    for layer in model.layers:
        for module in (layer.qkv, layer.o, layer.gate_up, layer.down):
            parts = module.parts if isinstance(module, StackedLinear) else [module]
            assert all(isinstance(p, PackedLinear) for p in parts)
    assert isinstance(model.lm_head, PackedLinear)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["Q4_K_M", "Q5_K"])
def test_exact_tier_on_the_codes_matches_hf(kquant_files, scheme):
    """fp32 on the codes: HF's greedy tokens, and each step's logprobs within fp32_tol of HF's."""
    from benchmarks.fidelity import hf_greedy, hf_logprobs

    path = kquant_files[scheme]
    hf = hf_on(path)
    llm = LLM(path, dtype="float32", quantization="gguf", enforce_eager=True, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ours = list(out.outputs[0].token_ids)
        assert ours == hf_greedy(hf, prompt, 12)
        ref = hf_logprobs(hf, prompt, ours)
        mine = torch.tensor([next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs], dtype=torch.float64)
        assert_close_to_oracle(mine, ref.gather(1, torch.tensor(ours)[:, None])[:, 0])


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["Q4_K_M", "Q6_K"])
def test_fast_tier_fidelity_on_kquant_files(kquant_files, scheme):
    """The fast tier's bar (mean KL <= 2e-3, top-1 >= 97 %) against HF fp32 on the same file."""
    from benchmarks.prompts import chat_prompts

    path = kquant_files[scheme]
    llm = LLM(path, enforce_eager=True, num_kv_blocks=64)
    prompts = [p.ids for p in chat_prompts(llm.get_tokenizer(), 6)]
    fid = measure(hf_on(path), llm.engine.model, prompts, 32)
    print(f"{scheme}: fast tier vs HF fp32 over {fid.tokens} tokens: mean KL {fid.mean_kl:.2e}, "
          f"top-1 {fid.top1:.1%}, max |logprob diff| {fid.max_logprob_diff:.3f}")
    assert fid.tokens >= 150
    assert fid.mean_kl <= KL_BAR
    assert fid.top1 >= top1_allowance(fid.tokens)
