"""In-place weight updates (verispec/models/weights.py), against a fresh load of the new weights.

The oracle for the exact and round-to-nearest tiers is a second `LLM` loaded from a checkpoint
that holds the new values: an updated engine must give the same tokens and logprobs to the
last bit. The GGUF fast tier is held to its fidelity bar against HF fp32 with the new weights.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_checkpoint, random_prompts
from verispec import LLM, SamplingParams
from verispec.models.loader import internal_name, load_checkpoint
from verispec.models.quant import quantize_rtn
from verispec.models.weights import build_update, check_update, expected_shapes, prepare

PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True)
PROMPTS = random_prompts(3, 4, 20, seed=11)


def outputs(llm: LLM) -> list:
    """Everything a request returns that the weights decide: tokens, logprobs, prompt logprobs.
    From an empty prefix cache, so that each run computes alike (the batch-invariance work is
    what will make a cache hit compute as a miss)."""
    llm.reset_prefix_cache()
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def state(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def variant(base: str, path, changes: dict[str, torch.Tensor]) -> str:
    """A copy of checkpoint `base` with some tensors replaced."""
    import shutil

    shutil.copytree(base, path)
    save_file(state(base) | changes, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return {arch: (make_tiny_checkpoint(root / f"{arch}_a", arch, seed=1),
                   make_tiny_checkpoint(root / f"{arch}_b", arch, seed=2)) for arch in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_expected_shapes_are_the_checkpoints(checkpoints, arch):
    """Every tensor HF writes (biases for Qwen2, q/k norms for Qwen3) and nothing else."""
    from verispec.models.config import ModelConfig
    import json

    path = checkpoints[arch][0]
    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(path, "config.json"))))
    written = {internal_name(n): tuple(t.shape) for n, t in state(path).items() if internal_name(n) is not None}
    assert expected_shapes(cfg) == written


@pytest.mark.parametrize("tier", [
    {"dtype": "float32", "enforce_eager": True},
    {"dtype": "bfloat16", "enforce_eager": True},
    {"quantization": "int4", "enforce_eager": True},
    {"quantization": "int8", "enforce_eager": True},
])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_an_update_gives_what_a_fresh_load_gives(checkpoints, arch, tier):
    a, b = checkpoints[arch]
    llm = LLM(a, **tier)
    before = outputs(llm)
    done = llm.update_weights(b)
    assert done.num_tensors == len(expected_shapes(llm.engine.model.cfg)) and done.weight_version == 1
    after = outputs(llm)
    assert after != before
    assert after == outputs(LLM(b, **tier))


@pytest.mark.parametrize("tier", [{"dtype": "float32", "enforce_eager": True}, {"quantization": "int4", "enforce_eager": True}])
def test_a_partial_update_keeps_the_other_parts_of_a_fused_matrix(checkpoints, tmp_path, tier):
    """q alone (of q|k|v), up alone (of gate|up), a bias and the tied embedding: the rest as loaded."""
    a, b = checkpoints["qwen2"]
    new = state(b)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.self_attn.v_proj.bias", "model.embed_tokens.weight"]
    changes = {n: new[n] for n in names}
    llm = LLM(a, **tier)
    llm.update_weights(list(changes.items()))
    assert outputs(llm) == outputs(LLM(variant(a, tmp_path / "v", changes), **tier))


def test_a_bad_tensor_is_named_and_nothing_changes(checkpoints):
    a, _ = checkpoints["llama"]
    llm = LLM(a, dtype="float32", enforce_eager=True)
    before = outputs(llm)
    good = state(a)
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = {
        "no tensor of that name": {"model.layers.9.mlp.up_proj.weight": good[q]},
        "has shape": {q: good[q][:-1]},
        "has dtype": {q: good[q].to(torch.int32)},
        "not a tensor": {q: good[q].tolist()},
        "NaN or infinite": {q: good[q] / 0},
    }
    for message, wrong in bad.items():
        with pytest.raises(ValueError, match=message):
            # The good tensors come first: a check that wrote as it went would leave them written.
            llm.update_weights({n: t + 1 for n, t in good.items() if n not in wrong} | wrong)
    with pytest.raises(ValueError, match="given twice"):
        llm.update_weights([(q, good[q] + 1), ("layers.0.self_attn.q_proj.weight", good[q])])
    assert outputs(llm) == before
    assert llm.stats()["weight_version"] == 0


def test_a_tied_head_takes_its_embedding(tmp_path):
    """A tied model's state dict lists the embedding twice (as lm_head.weight too): accepted when
    it is the embedding given beside it, refused when it is something else."""
    path = make_tiny_checkpoint(tmp_path / "tied", "llama", seed=3, tie_word_embeddings=True)
    llm = LLM(path, dtype="float32", enforce_eager=True)
    embed = state(path)["model.embed_tokens.weight"] + 0.5
    llm.update_weights({"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()})
    with pytest.raises(ValueError, match="ties its head"):
        llm.update_weights({"lm_head.weight": embed + 1})
    assert llm.stats()["weight_version"] == 1


def test_a_matrix_whose_format_would_change_is_refused_whole(checkpoints):
    """A re-quantized matrix must fit its kernel's tensors; here 8-bit codes for a 4-bit q."""
    a, b = checkpoints["llama"]
    llm = LLM(a, quantization="int4", enforce_eager=True)
    model = llm.engine.model
    new = prepare(check_update(state(b).items(), model.cfg), model)
    new["layers.1.q"] = quantize_rtn(new["layers.1.q"].dequantize(), 8)
    before = outputs(llm)
    with pytest.raises(ValueError, match="layers.1"):
        build_update(model, new)
    assert outputs(llm) == before


@pytest.mark.slow
def test_the_compiled_step_takes_new_weights_without_recompiling(checkpoints, monkeypatch):
    monkeypatch.setenv("VERISPEC_COMPILE", "1")
    a, b = checkpoints["llama"]
    llm = LLM(a, dtype="float32", enforce_eager=False)
    assert llm.engine.wait_for_compiled_step()
    before = outputs(llm)
    llm.update_weights(b)  # the graphs read each layer's tensors at every call: nothing to rebuild
    after = outputs(llm)
    assert after != before
    fresh = LLM(b, dtype="float32", enforce_eager=False)
    assert fresh.engine.wait_for_compiled_step()
    assert after == outputs(fresh)


@pytest.mark.slow
def test_the_gguf_fast_tier_meets_the_fidelity_bar_with_new_weights(smollm2_path, smollm2_hf):
    """Every tensor of SmolLM2 moved by 1 % of its spread, pushed as HF's state dict (the tied
    head included), re-quantized to the file's Q4_1 / Q8_0 blocks. The oracle is what a GGUF
    file of the new weights holds: HF fp32 with the blocks' exact values (4-bit rounding is the
    format's, not the tier's); against it the fast tier's bar (benchmarks/fidelity.py) holds."""
    import copy

    from benchmarks.fidelity import KL_BAR, measure
    from benchmarks.prompts import chat_prompts
    from test_fast_tier import top1_allowance

    hf = copy.deepcopy(smollm2_hf)  # the session's oracle stays as the file has it
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.01 * p.std()))
    llm = LLM()
    prompts = [p.ids for p in chat_prompts(llm.get_tokenizer(), 8)]
    done = llm.update_weights(hf.state_dict())
    assert done.num_tensors == len(expected_shapes(llm.engine.model.cfg))
    sources = llm.engine.model.sources
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if internal_name(n) in sources:
                p.copy_(sources[internal_name(n)].dequantize())
    fid = measure(hf, llm.engine.model, prompts, 32)
    print(f"updated fast tier vs HF fp32 over {fid.tokens} tokens: mean KL {fid.mean_kl:.2e}, top-1 {fid.top1:.1%}")
    assert fid.mean_kl <= KL_BAR
    assert fid.top1 >= top1_allowance(fid.tokens)
    # The file's own blocks kept their formats (Q4_1 layers, a Q8_0 head).
    _, loaded = load_checkpoint(smollm2_path, torch.bfloat16, "gguf")
    assert {n: w.kind for n, w in llm.engine.model.sources.items()} == \
           {n: w.kind for n, w in loaded.items() if hasattr(w, "kind")}


@pytest.mark.parametrize("tier", [{"dtype": "float32"}, {"quantization": "int4"}])
def test_tensor_parallel_ranks_write_their_shards(checkpoints, tier):
    """TP=2: both ranks take the update (values broadcast, each shards them), as a fresh TP=2 load."""
    a, b = checkpoints["qwen2"]
    llm = LLM(a, tensor_parallel_size=2, enforce_eager=True, **tier)
    try:
        before = outputs(llm)
        llm.update_weights(b)
        after = outputs(llm)
        with pytest.raises(ValueError, match="has shape"):  # checked on rank 0: the workers never see it
            llm.update_weights({"model.norm.weight": torch.ones(3)})
        assert outputs(llm) == after
    finally:
        llm.shutdown()
    fresh = LLM(b, tensor_parallel_size=2, enforce_eager=True, **tier)
    try:
        assert after != before and after == outputs(fresh)
    finally:
        fresh.shutdown()
