"""`verispec bench`: latency and throughput of verispec alone, on any model it loads.

For each batch size: time to first token (adding the batch until every request has its first
token), the median decode step, and generated tokens per second, each the median of `runs` timed
runs after one warm-up. Greedy, exactly `max_tokens` new tokens per request. Peers side by side
(HF transformers, llama.cpp), sweeps and plots live in the repository's `benchmarks/`
(`python -m benchmarks`), which is not installed with the package.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

PROMPT = ("Summarize the following in one paragraph. The committee met on Tuesday to review the budget "
          "for the coming year, the plan to hire four engineers, and the move to the new office.")


@dataclass(slots=True)
class BenchResult:
    batch_size: int
    ttft_ms: float  # until every request of the batch has its first token
    step_ms: float  # median decode step (no prefill in it)
    tok_s: float  # generated tokens / wall time, prefill included
    mean_acceptance_length: float | None  # with speculation: tokens per verify step


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default: %(default)s)")
    p.add_argument("--batch-sizes", default="1,16", help="comma list of batch sizes (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per figure, median reported (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def batch_sizes(value: str) -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be a comma list of integers >= 1; got {value!r}")
    return sizes


def measure(llm, prompt: list[int], batch: int, max_tokens: int, runs: int) -> BenchResult:
    """One warm-up, then `runs` timed runs of `batch` copies of `prompt` through the engine."""
    from verispec.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ttfts, steps, rates, before = [], [], [], llm.stats()
    for run in range(runs + 1):
        llm.reset_prefix_cache()  # each run computes its prompts in full, as the first did
        for i in range(batch):
            engine.add_request(f"bench-{run}-{i}", prompt, params)
        start = time.perf_counter()
        first, decode, started = None, [], set()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = engine.step()
            if first is not None:
                decode.append(time.perf_counter() - t0)
            started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
            if first is None and len(started) == batch:
                first = time.perf_counter() - start
        if run:  # run 0 warms up
            ttfts.append(first or 0.0)
            steps.append(statistics.median(decode) if decode else 0.0)
            rates.append(batch * max_tokens / (time.perf_counter() - start))
    after = llm.stats()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return BenchResult(
        batch_size=batch, ttft_ms=statistics.median(ttfts) * 1e3, step_ms=statistics.median(steps) * 1e3,
        tok_s=statistics.median(rates), mean_acceptance_length=1 + accepted / drafts if drafts else None,
    )


def format_table(results: list[BenchResult]) -> str:
    lines = ["| batch | TTFT ms | decode step ms | tok/s | mean acceptance length |", "|---|---|---|---|---|"]
    for r in results:
        acc = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
        lines.append(f"| {r.batch_size} | {r.ttft_ms:.1f} | {r.step_ms:.2f} | {r.tok_s:.1f} | {acc} |")
    return "\n".join(lines)


def run(args: argparse.Namespace, llm_kwargs: dict) -> int:
    from verispec.entrypoints.llm import LLM
    from verispec.models.cpu_kernels import kernel_build

    sizes = batch_sizes(args.batch_sizes)
    kernel_build(wait=True)  # a benchmark measures the kernels, not the start-up fallback while they build
    if args.max_tokens < 1 or args.runs < 1:
        raise ValueError("--max-tokens and --runs must be >= 1")
    llm = LLM(max_num_seqs=max(sizes), **llm_kwargs)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(PROMPT) if tokenizer is not None else list(range(3, 43))
    results = [measure(llm, prompt, b, args.max_tokens, args.runs) for b in sizes]
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(f"verispec, {len(prompt)}-token prompt, {args.max_tokens} new tokens, median of {args.runs} run(s)")
        print(format_table(results))
    return 0
