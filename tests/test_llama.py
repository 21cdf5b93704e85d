"""The model forward (models/llama.py, loaded by models/loader.py) against HF transformers on the same
weights: logits at every position."""

from __future__ import annotations

import pytest
import torch

from conftest import FP32_ATOL, FP32_RTOL, TINY_VOCAB, assert_close_to_oracle, hf_model, make_tiny_checkpoint
from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.models.kv_cache_tensors import new_layer_cache
from verispec.models.compile import LayerGraphs
from verispec.models.linear import KERNEL_MAX_ROWS
from verispec.models.llama import LlamaModel
from verispec.models.loader import load_checkpoint
from verispec.models.tokenizer_cache import load_tokenizer

BLOCK = 4


def run_ours(path: str, ids: list[int], chunks: list[int], dtype=torch.float32, compiled: bool = False,
             consecutive: bool = False, block: int = BLOCK, quantization: str | None = None) -> torch.Tensor:
    """Logits for every position, fed in the given chunk sizes through a scattered block table
    (gathered by attention) or a consecutive one (sliced). Blocks of 16 run the CPU decode kernel
    where it is available; blocks of 4 always run SDPA."""
    cfg, weights = load_checkpoint(path, dtype, quantization)
    model = LlamaModel(cfg, weights, dtype=dtype)
    num_blocks = max(len(ids), KERNEL_MAX_ROWS) // block + 8
    caches = [new_layer_cache(num_blocks, block, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
              for _ in range(cfg.num_layers)]
    if compiled:
        model.compiled = LayerGraphs(model, block)
        model.compiled.build()
    table = list(range(3, num_blocks)) if consecutive else torch.randperm(
        num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    outs, done = [], 0
    with torch.inference_mode():
        for n in chunks:
            meta = build_attention_metadata([SeqSpan(0, n, done + n, table)], block, torch.device("cpu"), dtype)
            hidden = model(torch.tensor(ids[done : done + n]), torch.arange(done, done + n), meta, caches)
            outs.append(model.compute_logits(hidden).float())
            done += n
    return torch.cat(outs)


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("block", [BLOCK, 16])
def test_prefill_and_decode_logits_match_hf(tiny_checkpoints, arch, consecutive, block):
    path = tiny_checkpoints[arch]
    ids = torch.randint(0, TINY_VOCAB, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    # A prefill chunk, a second chunk attending to the first through the cache, a verify-sized
    # step of short-query rows, then decode steps.
    ours = run_ours(path, ids, [21, 30, 5, 1, 1, 1, 1], consecutive=consecutive, block=block)
    assert_close_to_oracle(ours, hf_logits(path, ids))


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path):
    path = make_tiny_checkpoint(
        tmp_path / "l3", "llama", tie_word_embeddings=True, max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    cfg, _ = load_checkpoint(path, torch.float32)
    assert cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "llama3"
    ids = torch.randint(0, TINY_VOCAB, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = run_ours(path, ids, [100, 50])
    assert_close_to_oracle(ours, hf_logits(path, ids))


def test_bfloat16_close_to_fp32(tiny_llama):
    ids = list(range(5, 30))
    ours = run_ours(tiny_llama, ids, [25], dtype=torch.bfloat16)
    ref = hf_logits(tiny_llama, ids)
    # bf16 keeps ~3 significant digits; the argmax should mostly survive.
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_smollm2_gguf_logits_match_hf(smollm2_path, smollm2_hf, quantization):
    """Proves the GGUF loader, including undoing llama.cpp's q/k permutation; with
    quantization="gguf" the exact tier decodes the codes in the matmul kernel instead of up front."""
    tok = load_tokenizer(smollm2_path)
    ids = tok.encode("The quick brown fox jumps over the lazy dog because it wanted to see the river.")
    ours = run_ours(smollm2_path, ids, [len(ids) - 3, 1, 1, 1], quantization=quantization)
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0].float()
    # Measured: max |diff| 4.6e-5 on a Xeon, 1.17e-4 on an EPYC, on logits up to |31| (bound ~6e-4).
    assert_close_to_oracle(ours, ref)
    # The argmax is equal wherever the top two are not within the bound of each other.
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (FP32_ATOL + FP32_RTOL * ref.abs().amax(-1))
    assert clear.any() and torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
