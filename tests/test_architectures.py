"""The model families beyond Llama's (models/architectures.py): Gemma 2, Gemma 3, Phi-3 and a
Phi-4-mini-shaped Phi-3 (partial rotary, LongRoPE), each a tiny random model built from
transformers' own config class with its features switched on at sizes a short test reaches
(conftest.FAMILY_OVERRIDES: windows of 8 keys, soft-caps that bite). Against HF fp32: the logits
at every position (the SDPA path and the CPU kernel), greedy generation under batching and
chunked prefill, prompt and sampled logprobs, speculation equal to plain decoding, the prefix
cache, GGUF files as llama.cpp's converter writes them, and weight updates under HF's names."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    NEW_FAMILIES, TINY_VOCAB, assert_close_to_oracle, fp32_tol, hf_greedy, hf_model, make_tiny_checkpoint,
    random_prompts,
)
from gguf_files import hf_with_file_weights, write_gguf
from test_llama import hf_logits, run_ours
from verispec import LLM, SamplingParams
from verispec.models.architectures import SUPPORTED, family, gguf_parts, hf_parts
from verispec.models.loader import load_checkpoint, weight_kinds
from verispec.models.weights import check_update, read_safetensors

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in NEW_FAMILIES}


@pytest.fixture(scope="module")
def oracles(families):
    return {arch: hf_model(path) for arch, path in families.items()}


def context_of(path: str) -> int:
    """The engine context under which HF's own choice of LongRoPE factors matches ours on short
    sequences (HF picks by the sequence's length, verispec once per engine)."""
    cfg, _ = load_checkpoint(path, torch.float32)
    scaling = cfg.rope_scaling or {}
    return scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings


@pytest.mark.parametrize("arch", NEW_FAMILIES)
@pytest.mark.parametrize("block", [4, 16])  # 4: SDPA (windowed masks, soft-capped scores); 16: the CPU kernel
def test_logits_match_hf_at_every_position(families, arch, block, monkeypatch):
    path = families[arch]
    ids = torch.randint(0, TINY_VOCAB, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    short_context(monkeypatch, path)
    ours = run_ours(path, ids, [21, 30, 5, 1, 1, 1, 1], block=block)
    assert_close_to_oracle(ours, hf_logits(path, ids))


def short_context(monkeypatch, path: str) -> None:
    """run_ours builds the model straight from the loader: give it the context `context_of` says."""
    import test_llama

    def load(*args, **kwargs):
        cfg, weights = load_checkpoint(*args, **kwargs)
        cfg.rope_context = context_of(path)
        return cfg, weights

    monkeypatch.setattr(test_llama, "load_checkpoint", load)


def test_longrope_takes_the_long_factors_past_the_original_context(families, monkeypatch):
    """HF rotates a sequence longer than the original context (64) with the long factors; so does
    an engine whose context is longer, and only such an engine."""
    import test_llama

    path = families["phi4mini"]
    ids = torch.randint(0, TINY_VOCAB, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(path, ids)
    assert_close_to_oracle(run_ours(path, ids, [60, 36, 1, 1, 1, 1], block=16), ref)  # context 512 by default
    short_context(monkeypatch, path)
    assert not torch.allclose(test_llama.run_ours(path, ids, [100], block=16), ref, atol=1e-2)


def test_the_window_and_the_soft_caps_change_the_result(families, monkeypatch):
    """Without its window and soft-caps Gemma 2 is far off HF: the features above are exercised."""
    import test_llama

    path = families["gemma2"]
    ids = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()

    def plain(*args, **kwargs):
        cfg, weights = load_checkpoint(*args, **kwargs)
        cfg.sliding_window = cfg.attn_softcap = cfg.final_softcap = None
        return cfg, weights

    monkeypatch.setattr(test_llama, "load_checkpoint", plain)
    assert (test_llama.run_ours(path, ids, [40], block=16) - hf_logits(path, ids)).abs().max() > 0.1


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_greedy_batch_matches_hf_and_speculation_changes_nothing(families, oracles, arch):
    prompts = random_prompts(6, 3, 40, seed=4)
    kw = dict(max_num_batched_tokens=32, block_size=16, max_model_len=context_of(families[arch]))
    llm = LLM(families[arch], **kw)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    # Sequences stay under 64 tokens, where HF's LongRoPE choice is the short factors too.
    assert ours == [hf_greedy(oracles[arch], p, GREEDY.max_tokens) for p in prompts]
    spec = LLM(families[arch], speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 1}, **kw)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY, use_tqdm=False)] == ours
    assert spec.stats()["num_draft_tokens"] > 0


@pytest.mark.parametrize("arch", ["gemma2", "phi4mini"])
def test_prompt_and_sampled_logprobs_match_hf(families, oracles, arch):
    prompt = random_prompts(1, 30, 30, seed=5)[0]
    params = SamplingParams(temperature=0.8, seed=6, max_tokens=12, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    out = LLM(families[arch], block_size=16, max_model_len=context_of(families[arch])).generate(
        [prompt], params, use_tqdm=False)[0]
    tokens = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        logits = oracles[arch](torch.tensor([tokens])).logits[0].float()
    ref = logits.log_softmax(-1)
    tol = 2 * fp32_tol(logits.abs().max().item())
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) <= tol
    for j, tok in enumerate(out.outputs[0].token_ids):
        # Sampled at T = 0.8: the logprob of the distribution sampled from, as vLLM's processed mode
        # reports it, is checked elsewhere; the raw one is the model's own.
        assert abs(out.outputs[0].logprobs[j][tok].logprob - ref[len(prompt) - 1 + j, tok].item()) <= tol


def test_a_prefix_cached_request_equals_an_uncached_one_past_the_window(families):
    """Gemma 2's sliding layers see 8 keys: a 40-token shared prefix is reused from the cache and
    the continuation is what the uncached engine gives, prompt logprobs included."""
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared + [5, 6, 7], shared + [9, 10]]
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, ignore_eos=True)
    cold = LLM(families["gemma2"], block_size=16, enable_prefix_caching=False)
    warm = LLM(families["gemma2"], block_size=16, enable_prefix_caching=True)
    expected = [cold.generate([p], params, use_tqdm=False)[0] for p in prompts]
    got = [warm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert warm.stats()["prefix_cache_hits"] > 0
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [e and {t: x.logprob for t, x in e.items()} for e in a.prompt_logprobs] == \
               [e and {t: x.logprob for t, x in e.items()} for e in b.prompt_logprobs]


@pytest.mark.parametrize("arch, qtype", [(a, q) for a in NEW_FAMILIES for q in ("F32", "Q8_0")] + [("gemma2", "IQ4_NL")])
def test_gguf_files_match_hf_on_the_same_values(tmp_path, arch, qtype, monkeypatch):
    """A file as llama.cpp's converter writes it (norms as 1 + w, fused qkv, factors as tensors),
    read by verispec (Q8_0: the exact tier on the codes) against HF holding the file's values.
    The file cannot say Gemma's query scale, and Gemma 3's sliding pattern is its family's (five
    of six layers), as llama.cpp assumes: the checkpoint is made so. IQ4_NL: the exact values as
    8-bit codes."""
    over = {"gemma2": {"query_pre_attn_scalar": 16},
            "gemma3": {"num_hidden_layers": 6, "layer_types": None, "rope_parameters": None}}.get(arch, {})
    path = make_tiny_checkpoint(tmp_path / "hf", arch, **over)
    file = write_gguf(path, tmp_path / f"{arch}.gguf", qtype)
    ids = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    short_context(monkeypatch, path)
    ours = run_ours(file, ids, [21, 16, 1, 1, 1], block=16, quantization="gguf" if qtype != "F32" else None)
    with torch.no_grad():
        ref = hf_with_file_weights(path, file)(torch.tensor([ids])).logits[0].float()
    assert_close_to_oracle(ours, ref)
    if qtype == "IQ4_NL":
        assert weight_kinds(load_checkpoint(file, torch.float32, "gguf")[1]) == "IQ4_NL as exact 8-bit codes"
    if qtype != "F32":  # the fast tier packs the same blocks (a fused qkv split and stacked again)
        fast = run_ours(file, ids, [40], dtype=torch.bfloat16, block=16, quantization="gguf")
        assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_weight_updates_take_hf_names(families, arch):
    """An RL trainer sends HF's state dict: Gemma's norms as w (stored as 1 + w), Phi-3's fused
    tensors whole. Sending the model's own weights back changes no output."""
    llm = LLM(families[arch], block_size=16)
    prompts = random_prompts(3, 5, 20, seed=9)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.update_weights(families[arch])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before
    cfg, _ = load_checkpoint(families[arch], torch.float32)
    fused = [(n, t) for n, t in read_safetensors(families[arch]) if "qkv_proj" in n or "norm" in n][:1]
    with pytest.raises(ValueError, match="has shape"):
        check_update([(fused[0][0], fused[0][1][:-1])], cfg)


def test_every_family_names_its_tensors_once():
    """The table: each family's names map to distinct tensors, fused ones to their parts in order."""
    assert set(SUPPORTED) >= {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"}
    phi3 = family("phi3")
    assert hf_parts("model.layers.3.self_attn.qkv_proj.weight", phi3) == ("layers.3.q", "layers.3.k", "layers.3.v")
    assert gguf_parts("blk.0.ffn_up.weight", phi3) == ("layers.0.gate", "layers.0.up")
    gemma = family("gemma2")
    assert hf_parts("model.layers.0.post_attention_layernorm.weight", gemma) == ("layers.0.post_attn_norm",)
    assert hf_parts("model.layers.0.pre_feedforward_layernorm.weight", gemma) == ("layers.0.mlp_norm",)
    assert hf_parts("model.layers.0.post_attention_layernorm.weight", family("llama")) == ("layers.0.mlp_norm",)
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: llama, .*gemma2, gemma3, phi3"):
        family("gpt2")


@pytest.mark.parametrize("arch", ["gemma3", "phi4mini"])
def test_the_compiled_stack_matches_hf(families, arch, monkeypatch):
    """The layer stack as one graph: Gemma 3's two RoPE tables chosen per layer and its windowed
    layers, Phi-4-mini's partial rotary, through Inductor (chunks eager, decode rows compiled)."""
    path = families[arch]
    ids = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(10)).tolist()
    short_context(monkeypatch, path)
    ours = run_ours(path, ids, [17, 19, 1, 1, 1, 1], compiled=True)
    assert_close_to_oracle(ours, hf_logits(path, ids))


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_the_bf16_tier_keeps_hfs_top_token(families, arch, monkeypatch):
    """bfloat16 (the fast tier's activations): the argmax mostly survives, as for Llama."""
    path = families[arch]
    ids = list(range(5, 45))
    short_context(monkeypatch, path)
    ours = run_ours(path, ids, [40], dtype=torch.bfloat16, block=16)
    assert (ours.argmax(-1) == hf_logits(path, ids).argmax(-1)).float().mean() > 0.9
