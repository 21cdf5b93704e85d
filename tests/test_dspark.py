"""The DSpark / DFlash network (verispec/models/dspark.py) inside the engine, against a plain
reference of the published math (tests/dspark_checkpoints.py) fed by the HF target's own
hidden_states: every draft of every step, with the context built up step by step in the paged
cache (rejections, block boundaries, a batch) and recomputed from scratch by the reference."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_model, make_tiny_checkpoint, random_prompts
from dspark_checkpoints import make_dspark_checkpoint, reference_drafts
from verispec import LLM, SamplingParams
from verispec.models.dspark import DSparkModel
from verispec.models.dspark_checkpoint import read_dspark_checkpoint
from verispec.spec_decode.dspark_drafter import DSparkDrafter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer tiny llama (the drafters read layers 0 and 2), its config, its HF model."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("dspark_target") / "t", "llama", num_hidden_layers=4)
    with open(f"{path}/config.json") as f:
        return path, json.load(f), hf_model(path)


def recorded_drafts(monkeypatch, llm_kwargs: dict, prompts, params) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens up to its anchor, the drafts the engine drew) for every draft job."""
    seen = []
    original = DSparkDrafter.draft

    def draft(self, inputs, scheduled):
        out = original(self, inputs, scheduled)
        for s in scheduled:
            r = s.request
            if r.request_id in out:
                seen.append((list(r.token_ids[: r.num_computed_tokens + 1]), out[r.request_id].token_ids.tolist()))
        return out

    monkeypatch.setattr(DSparkDrafter, "draft", draft)
    llm = LLM(**llm_kwargs)
    if not llm_kwargs.get("enforce_eager"):  # the graphs return the layers the drafter reads, from the first step
        assert llm.engine.wait_for_compiled_step(), llm.engine.model.compiled.error
        # every piece compiled: one whose graph differed from eager would run eager, unseen by the drafts
        assert all(graph is not None for _, _, graph in llm.engine.model.compiled._pieces)
    llm.generate(prompts, params, use_tqdm=False)
    return seen


LAYOUTS = {
    "dspark": ({}, "dspark"),
    "dflash": ({"rank": 0, "confidence": False}, "dflash"),
    "reduced_vocab_two_layers": ({"draft_vocab": 100, "layers": 2, "block": 5}, "dspark"),
    "reduced_vocab_target_head_rows": ({"draft_vocab": 100, "own_head": False}, "dspark"),
    "top_level_config_one_layer_id": ({"top_level": True, "target_layer_ids": (1,), "prefix": "model."}, "dspark"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS) + ["dspark_compiled", "dspark_processed", "dflash_processed"])
def test_every_draft_equals_the_reference(target, tmp_path, monkeypatch, layout):
    """dspark_compiled: the target's compiled graph returns the layers the drafter reads;
    *_processed: drafts drawn slot by slot through the requests' processors (min_tokens=1 is a
    processor, idle past the first token) instead of the greedy argmax chain."""
    path, cfg, hf = target
    kw, method = LAYOUTS[layout.removesuffix("_compiled").removesuffix("_processed")]
    ckpt = make_dspark_checkpoint(tmp_path / "d", cfg, **kw)
    prompts = random_prompts(3, 5, 40, seed=1)
    compiled = layout.endswith("_compiled")
    llm = dict(model=path, dtype="float32", block_size=16 if compiled else 4, enforce_eager=not compiled,
               speculative_config={"method": method, "model": ckpt, "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, min_tokens=int(layout.endswith("_processed")))
    seen = recorded_drafts(monkeypatch, llm, prompts, params)
    assert len(seen) >= 30
    wrong = [(t, d) for t, d in seen if reference_drafts(ckpt, hf, t, len(d)) != d]
    assert wrong == []


def test_context_cache_is_what_a_fresh_pass_computes(target, tmp_path):
    """The context keys of a sequence computed in pieces (as steps compute them) equal one pass's."""
    _, cfg, _ = target
    dcfg, tensors = read_dspark_checkpoint(make_dspark_checkpoint(tmp_path / "d", cfg))
    model = DSparkModel(dcfg, tensors, cfg["vocab_size"], torch.float32, torch.device("cpu"))
    feats, pos = torch.randn(10, 2 * cfg["hidden_size"]), torch.arange(10)
    whole = model.context_kv(feats, pos)
    parts = [model.context_kv(feats[a:b], pos[a:b]) for a, b in ((0, 4), (4, 5), (5, 10))]
    for layer, (k, v) in enumerate(whole):
        assert torch.equal(torch.cat([p[layer][0] for p in parts]), k)
        assert torch.equal(torch.cat([p[layer][1] for p in parts]), v)


def test_heads(target, tmp_path):
    """The Markov bias is W2 W1[prev]; the confidence a sigmoid of [hidden; W1[prev]]; a reduced
    vocabulary's logits land on their target ids, -inf elsewhere."""
    _, cfg, _ = target
    dcfg, t = read_dspark_checkpoint(make_dspark_checkpoint(tmp_path / "d", cfg, draft_vocab=50))
    model = DSparkModel(dcfg, t, cfg["vocab_size"], torch.float32, torch.device("cpu"))
    prev, h = torch.tensor([7, 9]), torch.randn(2, cfg["hidden_size"])
    assert torch.allclose(model.markov_bias(prev), t["markov_w1.weight"][prev] @ t["markov_w2.weight"].t())
    want = torch.sigmoid(torch.cat([h, t["markov_w1.weight"][prev]], -1) @ t["confidence_head.proj.weight"].t()
                         + t["confidence_head.proj.bias"])[:, 0]
    assert torch.allclose(model.accept_chance(h, prev), want)
    full = model.to_target_vocab(torch.arange(100.0).view(2, 50), cfg["vocab_size"])
    ids = torch.arange(50) + t["d2t"]
    assert torch.equal(full[:, ids], torch.arange(100.0).view(2, 50))
    assert torch.isinf(full).sum() == 2 * (cfg["vocab_size"] - 50)
