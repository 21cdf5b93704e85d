"""The DSpark / DFlash drafter in the engine (verispec/spec_decode/dspark_drafter.py): lossless
output and exact logprobs beside plain decoding, its context cache through prefix caching and
preemption, adaptive verification on its confidence head, and the errors a user can meet."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_checkpoint, random_prompts
from dspark_checkpoints import make_dspark_checkpoint
from test_spec_decode import assert_same_logprobs, run_with_and_without
from verispec import LLM, SamplingParams
from verispec.spec_decode import dspark_drafter
from verispec.spec_decode.dspark_drafter import DSparkDrafter, latest_writes


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("dspark_engine") / "t", "llama", num_hidden_layers=4)
    with open(f"{path}/config.json") as f:
        return path, json.load(f)


def bigram_drafter(path: str, cfg: dict, prompts, dtype: str, out, **engine_kw) -> str:
    """A drafter whose Markov head holds the target's own greedy bigrams in `dtype` (bias 20):
    most of its drafts are accepted, so acceptance paths run as much as rejections."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = LLM(path, dtype=dtype, **engine_kw).generate(prompts, params, use_tqdm=False)
    vocab = cfg["vocab_size"]
    counts = torch.zeros(vocab, vocab)
    for p, o in zip(prompts, outs):
        seq = p + o.outputs[0].token_ids
        for a, b in zip(seq, seq[1:]):
            counts[a, b] += 1
    bias = torch.zeros(vocab, vocab)
    bias[torch.arange(vocab), counts.argmax(1)] = 20.0 * (counts.sum(1) > 0)
    return make_dspark_checkpoint(out, cfg, markov=bias, block=6)


PROMPTS = random_prompts(8, 5, 30, seed=7)


@pytest.fixture(scope="module")
def hitting(target, tmp_path_factory):
    """(the fp32 bigram drafter, its prompts)"""
    return bigram_drafter(*target, PROMPTS, "float32", tmp_path_factory.mktemp("hit") / "d"), PROMPTS


def _avx512_bf16() -> bool:
    """torch at its AVX512 level on a CPU with AVX512-BF16 (AMD EPYC Zen 4)."""
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_bf16" in flags


# A known defect, kept failing loudly if it goes away (strict): on that CPU a bf16 batch of 8
# gives DSpark's greedy output a token apart from plain's (prompt 2, token 28). Its cause is
# wider: there the dense bf16 tier is not batch-invariant even without drafting (a batch of 8
# against each prompt alone: 3 of 8 prompts differ, at torch's AVX512 and AVX2 levels, eager or
# compiled, verispec's kernels on or off), while torch's bf16 matmuls give every row the bits it
# has alone. Which op's rows depend on the batch is not found yet; this test passes at the AVX2
# level only because its two runs share their batch.
_BF16_ROWS = pytest.mark.xfail(_avx512_bf16(), strict=True,
                               reason="dense bf16 rows depend on the batch on AVX512-BF16 (see above)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_and_drafts_land(target, hitting, tmp_path, dtype, batch, request):
    if dtype == "bfloat16" and batch == 8:
        request.applymarker(_BF16_ROWS)
    path, cfg = target
    ckpt, prompts = hitting
    if dtype != "float32":  # its greedy paths are its own
        ckpt = bigram_drafter(path, cfg, prompts, dtype, tmp_path / "d", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    _, _, stats = run_with_and_without(path, prompts[:batch], params, {"method": "dspark", "model": ckpt},
                                       dtype=dtype, block_size=4)
    assert stats["num_draft_tokens"] > 0
    # A random drafter lands nothing here; the bigrams (ambiguous across prompts) land often.
    assert stats["num_accepted_tokens"] / stats["num_drafts"] > 0.7
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_default_draft_count_is_the_block(target, hitting):
    llm = LLM(target[0], speculative_config={"method": "dspark", "model": hitting[0]})
    assert llm.engine.drafts.k == 6  # block 6, every slot predicts


@pytest.mark.parametrize("kw, method", [({"rank": 0, "confidence": False}, "dflash"), ({}, "dspark")])
def test_logprobs_equal_plain(target, hitting, tmp_path, kw, method):
    """Every logprobs mode; penalties read the drafts' values on the device. (Random requests
    are verified against q, so their outputs are equal in distribution: test_spec_decode.py.)"""
    path, cfg = target
    ckpt = hitting[0] if method == "dspark" else make_dspark_checkpoint(tmp_path / "d", cfg, **kw)
    prompts = hitting[1][:4]
    params = [SamplingParams(temperature=0, max_tokens=32, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=32, logprobs=2, repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=32, logprobs=1, presence_penalty=0.5, ignore_eos=True,
                             logprobs_mode="processed_logprobs"),
              SamplingParams(temperature=0, max_tokens=32, logprobs=2, top_k=4, ignore_eos=True, logprobs_mode="raw_logits")]
    spec = {"method": method, "model": ckpt, "num_speculative_tokens": 3}
    base, out, stats = run_with_and_without(path, prompts, params, spec, dtype="float32")
    assert stats["num_draft_tokens"] > 0
    assert_same_logprobs(base, out)


def test_context_survives_prefix_caching_and_preemption(target, hitting):
    """Blocks reused from the prefix cache hold the drafter's context too, and a preempted request
    recomputes both: the output and the drafts' acceptance equal an unpressed engine's."""
    path, _ = target
    ckpt, prompts = hitting
    prompts = [prompts[0] + p[:3] for p in prompts]  # a shared prefix
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = {"method": "dspark", "model": ckpt, "num_speculative_tokens": 4}
    calm = LLM(path, dtype="float32", block_size=4, enable_prefix_caching=False, speculative_config=spec)
    want = calm.generate(prompts, params, use_tqdm=False)
    calm_rate = calm.stats()["num_accepted_tokens"] / calm.stats()["num_drafts"]
    pressed = LLM(path, dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24,
                  enable_prefix_caching=True, speculative_config=spec)
    got = pressed.generate(prompts, params, use_tqdm=False)
    stats = pressed.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # As many drafts land: a stale or missing context would draft worse.
    assert stats["num_accepted_tokens"] / stats["num_drafts"] > 0.8 * calm_rate


def test_adaptive_verification_on_the_confidence_head(target, hitting):
    path, _ = target
    ckpt, prompts = hitting
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = {"method": "dspark", "model": ckpt, "adaptive_verification": True,
            "cost_table": [[1, 0.010], [8, 0.011], [64, 0.030]]}
    _, _, stats = run_with_and_without(path, prompts, params, spec, dtype="float32")
    assert stats["adaptive"]["admitted_total"] > 0 and stats["num_accepted_tokens"] > 0
    llm = LLM(path, speculative_config=spec)
    table = llm.engine.drafts.adaptive.calibration[0]
    assert table[0] < 0.05 and table[-1] > 0.95  # the head's chances, not the 0.8 prior



def test_the_cost_model_learns_what_the_drafting_costs(target, hitting):
    """With a profiled table, each step's drafting (the block forward, timed in the step) is
    learnt apart, so adaptive verification charges it to every budget but none."""
    path, _ = target
    ckpt, prompts = hitting
    llm = LLM(path, dtype="float32", speculative_config={"method": "dspark", "model": ckpt,
                                                         "adaptive_verification": True})
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    cost = llm.engine.drafts.adaptive.cost
    assert cost.learn and cost.drafting > 0



def test_latest_writes_keeps_each_slots_last_write():
    slots, rows = latest_writes(torch.tensor([7, 3, 7, 9, 3, 7]))
    assert slots.tolist() == [3, 7, 9] and rows.tolist() == [4, 5, 3]


def test_context_writes_wait_for_a_draft_and_a_full_buffer_writes_them_early(target, hitting, monkeypatch):
    """Pending writes (a CPU's) and writes at every step draft alike: the same greedy output and
    the same acceptance, through prefix-cache hits and slots rewritten after rejected drafts."""
    path, _ = target
    ckpt, prompts = hitting
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "dspark", "model": ckpt}

    def run():
        llm = LLM(path, dtype="float32", speculative_config=spec)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:3] * 2, params, use_tqdm=False)]
        return outs, llm.stats()["num_accepted_tokens"], llm.engine.drafts.drafter

    pending_outs, pending_accepted, drafter = run()
    assert drafter._pending  # the last steps' writes wait: no draft came after them
    monkeypatch.setattr(dspark_drafter, "PENDING_TOKENS", 1)  # every write at once
    eager_outs, eager_accepted, drafter = run()
    assert not drafter._pending
    assert pending_outs == eager_outs and pending_accepted == eager_accepted


@pytest.mark.parametrize("spec, kw, message", [
    ({"method": "dspark"}, {"rank": 0, "confidence": False}, "method 'dflash'"),
    ({"method": "dflash"}, {}, "method 'dspark'"),
    ({"method": "dspark", "num_speculative_tokens": 5}, {"block": 4}, "num_speculative_tokens=5 exceeds"),
])
def test_user_errors_name_the_fix(target, tmp_path, spec, kw, message):
    ckpt = make_dspark_checkpoint(tmp_path / "d", target[1], **kw)
    with pytest.raises(ValueError, match=message):
        LLM(target[0], speculative_config={**spec, "model": ckpt})


def test_dflash_needs_a_model_and_the_shipped_drafter_fits_only_its_target(target):
    from verispec.config import SpeculativeConfig

    with pytest.raises(ValueError, match="speculative_config.model is required for method 'dflash'"):
        SpeculativeConfig.parse({"method": "dflash"})
    with pytest.raises(ValueError, match="ships is for SmolLM2-135M-Instruct .*verispec train-drafter"):
        LLM(target[0], speculative_config={"method": "dspark"})


def test_the_target_hands_over_its_layers_once_per_forward(target, hitting):
    """The captured states go to the drafter and are dropped: none is read twice."""
    llm = LLM(target[0], speculative_config={"method": "dspark", "model": hitting[0]})
    model = llm.engine.model
    assert model.capture_layers == (0, 2)
    llm.generate([hitting[1][0]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert model.captured is None
    assert isinstance(llm.engine.drafts.drafter, DSparkDrafter)


@pytest.mark.slow
def test_the_shipped_drafter_lands_drafts_on_questions_it_never_trained_on(smollm2_path):
    """{"method": "dspark"} alone loads the drafter verispec ships for the default model; on two
    held-out questions, greedy, its drafts land (the figure docs/dspark.md reports, with margin)
    and the output is plain decoding's."""
    from verispec.train.prompts import held_out_prompts

    questions = [[{"role": "user", "content": q}] for q in held_out_prompts(2)]
    params = SamplingParams(temperature=0, max_tokens=64)
    plain = LLM(smollm2_path, num_kv_blocks=64).chat(questions, params, use_tqdm=False)
    llm = LLM(smollm2_path, num_kv_blocks=64, speculative_config={"method": "dspark"})
    out = llm.chat(questions, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["mean_acceptance_length"] >= SHIPPED_ACCEPTANCE_FLOOR, llm.stats()["mean_acceptance_length"]


# The shipped drafter's mean acceptance length on those questions, less a margin (docs/dspark.md).
SHIPPED_ACCEPTANCE_FLOOR = 1.1
