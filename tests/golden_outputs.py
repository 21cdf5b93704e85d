"""A fixed set of requests run under every engine shape that touches the step's structure (both
tiers, plain and every drafter, adaptive verification, structured output, tensor parallelism),
reduced to one digest per shape: the emitted tokens, every logprob and every prompt logprob, bit
for bit (floats as their hex), and the drafting counters (how many drafts were proposed, verified
and accepted at each position: prompt lookup's tokens are the plain ones whatever it drafts). tests/test_golden_outputs.py holds the digests against the ones
recorded for this machine's kernels, so a change meant to keep behaviour keeps it exactly.

Adaptive verification runs on a given cost table: a profiled one depends on the machine's timing,
and so would which drafts are verified (and with them a sampled request's tokens)."""

from __future__ import annotations

import hashlib
import json

import torch

from verispec.sampling_params import SamplingParams, StructuredOutputsParams

# Rising cost per token: drafts pay at small batches and stop paying as the step grows.
COST_TABLE = [[1, 0.010], [2, 0.0105], [4, 0.0115], [8, 0.0135], [16, 0.020], [32, 0.034], [64, 0.062]]

_LIST = "apples, pears, plums, figs, dates, limes, kiwis, grapes"
SMOLLM2_PROMPTS = [
    f"Repeat this list exactly, twice: {_LIST}. Answer: {_LIST}.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def smollm2_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.8, seed=7, logprobs=2, n=2),
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.2, logprobs=1),
    ]


def _adaptive(spec: dict) -> dict:
    return {**spec, "adaptive_verification": True, "cost_table": COST_TABLE}


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
LAYER_SKIP = {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 3}
SMOLLM2_FAST = {
    "fast plain": None,
    "fast ngram": NGRAM,
    "fast ngram adaptive": _adaptive(NGRAM),
    "fast suffix adaptive": _adaptive(SUFFIX),
    "fast layer_skip adaptive": _adaptive(LAYER_SKIP),
}
SMOLLM2_EXACT = {
    "exact plain": None,
    "exact suffix": SUFFIX,
    "exact layer_skip": LAYER_SKIP,
}


# The engine's counters that record its drafting decisions (LLM.stats()).
DRAFT_COUNTERS = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                  "adaptive", "num_preemptions")


def digest(outputs, stats: dict | None = None) -> str:
    """sha256 of every output's tokens, logprobs (hex) and prompt logprobs (hex), and of the
    engine's drafting counters."""
    def rows(table):
        if table is None:
            return None
        return [None if row is None else sorted((t, lp.logprob.hex(), lp.rank) for t, lp in row.items())
                for row in table]

    record = [
        {"prompt_logprobs": rows(out.prompt_logprobs),
         "outputs": [{"tokens": c.token_ids, "text": c.text, "logprobs": rows(c.logprobs), "finish": c.finish_reason,
                      "cumulative": None if c.cumulative_logprob is None else float(c.cumulative_logprob).hex()}
                     for c in out.outputs]}
        for out in outputs
    ]
    counters = {k: stats[k] for k in DRAFT_COUNTERS if k in stats} if stats is not None else None
    if counters and "adaptive" in counters:  # decisions only: these reports came later
        late = ("calibration", "drafting_steps", "probes")
        counters["adaptive"] = {k: v for k, v in counters["adaptive"].items() if k not in late}
    return hashlib.sha256(json.dumps([record, counters]).encode()).hexdigest()


def _generate(llm, prompts, params) -> str:
    """The digest of one batch; the counters are the engine's since it started (a fresh engine per
    shape, so every shape's first batch counts from zero)."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return digest(outputs, llm.stats())


def smollm2_digests(dtype: str, shapes: dict) -> dict[str, str]:
    from verispec import LLM

    out = {}
    for name, spec in shapes.items():
        llm = LLM(dtype=dtype, max_num_batched_tokens=64, num_kv_blocks=256, speculative_config=spec, seed=0)
        out[name] = _generate(llm, SMOLLM2_PROMPTS, smollm2_params())
        if name == "fast ngram":  # structured output with drafts: only drafts the grammar allows are verified
            choice = StructuredOutputsParams(choice=["apples, pears, plums", "figs and dates", "no fruit"])
            so = [SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, structured_outputs=choice),
                  SamplingParams(max_tokens=16, temperature=0.7, seed=3, structured_outputs=StructuredOutputsParams(
                      regex=r"(apples|pears|plums)(, (apples|pears|plums)){2,5}\."))]
            out["fast ngram structured"] = _generate(llm, SMOLLM2_PROMPTS[:2], so)
        llm.shutdown()
    return out


def tiny_digests(target: str, draft: str) -> dict[str, str]:
    """A tiny llama: a draft model (plain and adaptive) and tensor parallelism, in fp32."""
    from verispec import LLM

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 17)]
    prompts[1] = prompts[1][:20] * 2  # a repeat for prompt lookup to find
    params = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, prompt_logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, seed=11, logprobs=2, ignore_eos=True, n=2),
              SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=0.5, ignore_eos=True)]
    shapes = {
        "tiny draft_model": ({"method": "draft_model", "model": draft, "num_speculative_tokens": 3}, 1),
        "tiny draft_model adaptive": (_adaptive({"method": "draft_model", "model": draft,
                                                 "num_speculative_tokens": 4}), 1),
        "tiny tp2 plain": (None, 2),
        "tiny tp2 ngram": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, 2),
    }
    out = {}
    for name, (spec, tp) in shapes.items():
        llm = LLM(target, dtype="float32", max_num_batched_tokens=32, speculative_config=spec,
                  tensor_parallel_size=tp, seed=0)
        out[name] = _generate(llm, prompts, params)
        llm.shutdown()
    return out
