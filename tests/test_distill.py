"""Self-distillation data (verispec/train/distill.py): the features are the HF target's
hidden_states at the drafter's layers, the top entries its next-token distribution, and shards
already written are not made again."""

from __future__ import annotations

import torch

from conftest import hf_model, make_tiny_checkpoint
from verispec import LLM
from verispec.train.distill import build_shards, load_samples, target_features


def test_features_and_top_entries_are_the_targets(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "t", "llama", num_hidden_layers=4)
    llm = LLM(path, dtype="float32")
    ids = list(range(5, 305))  # two chunks
    s = target_features(llm.engine.model, ids, 40, (0, 2), top_k=4)
    with torch.no_grad():
        out = hf_model(path)(torch.tensor([ids]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], -1)
    assert s.features.dtype == torch.bfloat16 and s.features.shape == (300, 128)
    assert torch.allclose(s.features.float(), want.bfloat16().float(), atol=2e-2, rtol=2e-2)
    probs = out.logits[0].softmax(-1)
    top_p, top_i = probs.topk(4, -1)
    assert (s.top_ids.long() == top_i).float().mean() > 0.99
    assert torch.allclose(s.top_probs.float(), top_p, atol=1e-3)
    assert s.answer_start == 40 and s.ids.tolist() == ids
    assert llm.engine.model.capture_layers == () and llm.engine.model.captured is None  # as it was


def test_shards_are_made_once(tiny_tok, tmp_path):
    llm = LLM(tiny_tok, dtype="float32")
    prompts = ["Explain rain.", "Write a poem about owls.", "Why is snow white?"]
    paths = build_shards(llm, prompts, tmp_path, (0,), max_tokens=6, top_k=3)
    samples = load_samples(paths)
    assert len(paths) == 1 and len(samples) == 3
    for s in samples:
        assert len(s.ids) - s.answer_start == 6 and s.features.shape == (len(s.ids), 64)
        assert s.top_ids.shape == (len(s.ids), 3)
    stamp = paths[0].stat().st_mtime_ns
    assert build_shards(llm, prompts, tmp_path, (0,), max_tokens=6, top_k=3) == paths
    assert paths[0].stat().st_mtime_ns == stamp
