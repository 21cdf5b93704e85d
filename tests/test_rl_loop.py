"""examples/rl_loop.py, short: a GRPO-style loop on the tiny llama (HF fp32 trainer, verispec exact
tier rollouts, update_weights after every step). LLM.score equals the rollout exactly; the rollout
vs the trainer stays within the fp32 bound of two computations of the same logits."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import torch

from verispec import LLM, SamplingParams

from conftest import fp32_tol, hf_model, random_prompts

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "rl_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rl_loop"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_short_rl_loop_scores_exactly_and_stays_within_the_fp32_bound(tiny_llama, tmp_path):
    rl = load_example()
    prompts = random_prompts(3, 5, 12, seed=7)
    even = lambda i, text, ids: sum(t % 2 == 0 for t in ids) / len(ids)  # noqa: E731 - varies within a group
    llm = LLM(tiny_llama, dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    before = llm.generate(prompts, greedy, use_tqdm=False)
    history = rl.run(tiny_llama, prompts, even, steps=3, n=4, max_tokens=12, temperature=0.8, lr=1e-3, llm=llm)
    after = llm.generate(prompts, greedy, use_tqdm=False)
    assert after[0].weight_version == 3 and llm.stats()["num_weight_updates"] == 3
    assert any(a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(after, before))  # the steps took
    with torch.no_grad():
        scale = hf_model(tiny_llama)(torch.tensor([prompts[0]])).logits.abs().max().item() / 0.8
    assert [s.step for s in history] == [0, 1, 2]
    for s in history:
        assert s.score_gap == 0.0  # LLM.score gives the rollout's bits
        assert s.gap_max <= 2 * fp32_tol(scale), (s.gap_max, scale)  # the trainer agrees within rounding
        assert 0 < s.num_tokens <= 3 * 4 * 12 and 0.0 <= s.reward <= 1.0 and s.update_s > 0
    rl.plot(history, str(tmp_path / "rl.png"), bound=2 * fp32_tol(scale))
    assert (tmp_path / "rl.png").stat().st_size > 10_000
