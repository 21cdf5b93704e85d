"""Logprobs against an independent oracle: HF transformers' logits, and HF's own logits
processors for the processed modes, on the same weights."""

from __future__ import annotations

from dataclasses import replace

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY_VOCAB, fp32_tol, hf_model, hf_processed, random_prompts
from verispec import LLM, SamplingParams

MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_batched_tokens=32, block_size=4, max_logprobs=-1)


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    return hf_model(tiny_llama)


def hf_rows(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF logits for every position of prompt + output, fp32 [L, V]."""
    with torch.no_grad():
        return model(torch.tensor([prompt + output])).logits[0].float()


def reference_scores(row: torch.Tensor, params: SamplingParams, history: list[int], mode: str) -> tuple[torch.Tensor, float]:
    """The oracle's scores for one row in `mode`, and their fp32 bound: the logits' own bound, times
    what processing multiplies logits by (1/temperature, the repetition penalty), doubled for
    logprobs (log-softmax subtracts a log-sum-exp whose error is at most the largest logit error)."""
    raw = mode.startswith("raw")
    scores = row if raw else hf_processed(row, params, history)
    gain = 1.0 if raw else max(1.0, params.repetition_penalty) / min(1.0, params.temperature or 1.0)
    tol = fp32_tol(row.abs().max()) * gain * (2 if mode.endswith("logprobs") else 1)
    return (torch.log_softmax(scores, -1) if mode.endswith("logprobs") else scores), tol


def assert_entry_matches(entry: dict, ref: torch.Tensor, chosen: int, k: int, tol: float) -> None:
    assert chosen in entry
    assert len(entry) in (k, k + 1)
    for tok, lp in entry.items():
        want = ref[tok].item()
        if want == float("-inf"):
            assert lp.logprob == float("-inf")
        else:
            assert abs(lp.logprob - want) <= tol, (tok, lp.logprob, want, tol)
    # The sampled token's rank counts entries scoring >= it; an entry within the bound of the
    # chosen one may fall on either side on another machine.
    assert rank_bounds(ref, chosen, tol)[0] <= entry[chosen].rank <= rank_bounds(ref, chosen, tol)[1]
    # The alternatives are the top k by score.
    top = set(torch.topk(ref, k).indices.tolist()) if k else set()
    alts = {t for t in entry if t != chosen} | ({chosen} if len(entry) == k else set())
    top_vals = sorted((ref[t].item() for t in top), reverse=True)
    alt_vals = sorted((ref[t].item() for t in alts), reverse=True)
    assert alt_vals == pytest.approx(top_vals, abs=tol)


def rank_bounds(ref: torch.Tensor, token: int, tol: float) -> tuple[int, int]:
    """The rank of `token` (1 + entries scoring above it) allowing every near-tie either way."""
    value = ref[token]
    return int((ref > value + 2 * tol).sum()) + 1, int((ref >= value - 2 * tol).sum())


CASES = [
    SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=1, max_tokens=6, logprobs=4, prompt_logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.3, top_k=20, seed=2, max_tokens=6, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=6, logprobs=3, prompt_logprobs=1, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, top_k=50, top_p=0.95, seed=4, max_tokens=6, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.8, repetition_penalty=1.5, seed=5, max_tokens=8, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=8, logprobs=2, ignore_eos=True),
]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_matches_hf(llm, oracle, mode):
    prompts = random_prompts(len(CASES), 5, 40, seed=11)
    params = []
    for p in CASES:
        params.append(replace(p, logprobs_mode=mode))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        c = out.outputs[0]
        rows = hf_rows(oracle, prompt, c.token_ids)
        for j, tok in enumerate(c.token_ids):
            history = prompt + c.token_ids[:j]
            ref, tol = reference_scores(rows[len(prompt) - 1 + j], p, history, mode)
            assert_entry_matches(c.logprobs[j], ref, tok, p.logprobs, tol)
        if p.prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
            # Prompt positions: only the position-independent processors apply.
            pos_params = replace(p, repetition_penalty=1.0)
            for i in range(1, len(prompt)):
                ref, tol = reference_scores(rows[i - 1], pos_params, [], mode)
                assert_entry_matches(out.prompt_logprobs[i], ref, prompt[i], p.prompt_logprobs, tol)
        if mode.endswith("logprobs"):
            assert c.cumulative_logprob == pytest.approx(sum(c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)), abs=1e-4)


def test_mixed_modes_in_one_batch(llm, oracle):
    prompts = random_prompts(4, 5, 20, seed=12)
    params = [
        SamplingParams(temperature=0.5, top_k=10, seed=i, max_tokens=5, logprobs=k, logprobs_mode=m, ignore_eos=True)
        for i, (m, k) in enumerate(zip(MODES, [1, 3, 5, 7]))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        c = out.outputs[0]
        rows = hf_rows(oracle, prompt, c.token_ids)
        for j, tok in enumerate(c.token_ids):
            ref, tol = reference_scores(rows[len(prompt) - 1 + j], p, prompt + c.token_ids[:j], p.logprobs_mode.value)
            assert_entry_matches(c.logprobs[j], ref, tok, p.logprobs, tol)


def test_engine_default_mode_and_per_request_override(tiny_llama):
    llm = LLM(tiny_llama, logprobs_mode="processed_logits")
    p = SamplingParams(temperature=0.5, seed=0, max_tokens=2, logprobs=0, ignore_eos=True)
    default = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0]
    q = replace(p, logprobs_mode="raw_logprobs")
    override = llm.generate([[5, 6, 7]], q, use_tqdm=False)[0].outputs[0]
    tok = default.token_ids[0]
    assert default.token_ids == override.token_ids
    assert default.logprobs[0][tok].logprob > 0 or override.logprobs[0][tok].logprob <= 0
    assert override.logprobs[0][tok].logprob <= 0  # a logprob
    assert default.logprobs[0][tok].logprob != override.logprobs[0][tok].logprob


def test_full_vocab(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1), use_tqdm=False)[0]
    assert all(len(d) == TINY_VOCAB for d in out.outputs[0].logprobs)
    assert all(len(d) == TINY_VOCAB for d in out.prompt_logprobs[1:])
    total = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs[0].values()]).exp().sum()
    assert abs(total.item() - 1.0) < 1e-4


def test_max_logprobs_cap(tiny_llama):
    llm = LLM(tiny_llama, max_logprobs=5)
    with pytest.raises(ValueError, match="max_logprobs=5"):
        llm.generate([[5, 6]], SamplingParams(logprobs=6), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs=5"):
        llm.generate([[5, 6]], SamplingParams(prompt_logprobs=-1), use_tqdm=False)


def test_custom_token_ids_mixed_with_topk(llm, oracle):
    prompts = random_prompts(3, 5, 15, seed=13)
    custom = [7, 100, 300, 511]
    params = [
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4, logprob_token_ids=custom, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=9, max_tokens=4, logprobs=5, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        c = out.outputs[0]
        rows = hf_rows(oracle, prompt, c.token_ids)
        for j, tok in enumerate(c.token_ids):
            ref, tol = reference_scores(rows[len(prompt) - 1 + j], p, [], "raw_logprobs")
            entry = c.logprobs[j]
            if p.logprob_token_ids:
                assert set(entry) == set(custom) | {tok}
                for t in custom:
                    assert abs(entry[t].logprob - ref[t].item()) <= tol
            else:
                # The top-k rows of the other requests stay correct (never -inf).
                assert_entry_matches(entry, ref, tok, p.logprobs, tol)


def test_prompt_logprobs_identical_with_chunking_and_preemption(tiny_llama):
    prompts = random_prompts(6, 20, 60, seed=14)
    params = SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=4, logprobs=2, ignore_eos=True)

    def run(**kw):
        outs = LLM(tiny_llama, block_size=4, **kw).generate(prompts, params, use_tqdm=False)
        return outs

    base = run(max_num_batched_tokens=512)
    chunked = run(max_num_batched_tokens=7)
    small = LLM(tiny_llama, block_size=4, max_num_batched_tokens=24, num_kv_blocks=30)
    pressured = small.generate(prompts, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    for a, b, c in zip(base, chunked, pressured):
        for other in (b, c):
            assert other.outputs[0].token_ids == a.outputs[0].token_ids
            assert len(other.prompt_logprobs) == len(a.prompt_logprobs)
            for ea, eo in zip(a.prompt_logprobs[1:], other.prompt_logprobs[1:]):
                assert ea.keys() == eo.keys()
                assert all(abs(ea[t].logprob - eo[t].logprob) < 1e-5 and ea[t].rank == eo[t].rank for t in ea)


@pytest.mark.skipif(not sys.platform.startswith("linux") or "glibc" not in " ".join(platform.libc_ver()),
                    reason="reads /proc and relies on glibc's MALLOC_MMAP_THRESHOLD_ to return freed memory")
def test_prompt_logprobs_memory_is_bounded(tmp_path):
    """prompt_logprobs=20 on a 4096-token prompt over a 49k vocab stays within 64 MiB of the run
    without prompt logprobs: rows are scored in bounded chunks, never [4096, V] at once.

    Measured as peak resident memory in a fresh process whose allocator returns large blocks to
    the OS at once (MALLOC_MMAP_THRESHOLD_), so the high-water mark tracks live memory."""
    script = Path(__file__).with_name("memory_probe.py")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "wide")], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    peaks = json.loads(res.stdout.strip().splitlines()[-1])
    if "skip" in peaks:
        pytest.skip(peaks["skip"])
    # A single [4096, 49152] fp32 logits tensor alone would be 768 MiB.
    for mode in ("raw_logprobs", "processed_logprobs"):
        extra = peaks[mode] - peaks["without"]
        assert extra <= 64 * 2**20, f"{mode}: prompt logprobs took {extra / 2**20:.1f} MiB extra"


@pytest.mark.slow
def test_smollm2_raw_logprobs_match_hf(smollm2_llm, smollm2_hf):
    """Sampled-token and prompt-token raw logprobs on the bundled model, within the fp32 bound of
    each row's logits (about 1.3e-3 on rows whose largest logit is 31)."""
    tok = smollm2_llm.get_tokenizer()
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. Then it")
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    out = smollm2_llm.generate([prompt], params, use_tqdm=False)[0]
    c = out.outputs[0]
    with torch.no_grad():
        logits = smollm2_hf(torch.tensor([prompt + c.token_ids])).logits[0].float()
    entries = [(len(prompt) - 1 + j, e) for j, e in enumerate(c.logprobs)]
    entries += [(i - 1, out.prompt_logprobs[i]) for i in range(1, len(prompt))]
    worst = 0.0
    for row, entry in entries:
        ref, tol = reference_scores(logits[row], params, [], "raw_logprobs")
        for tok_id, lp in entry.items():
            worst = max(worst, abs(lp.logprob - ref[tok_id].item()) / tol)
    for j, t in enumerate(c.token_ids):
        ref, tol = reference_scores(logits[len(prompt) - 1 + j], params, [], "raw_logprobs")
        lo, hi = rank_bounds(ref, t, tol)
        assert lo <= c.logprobs[j][t].rank <= hi
    assert worst <= 1.0, f"worst |diff| is {worst:.2f}x the fp32 bound"
