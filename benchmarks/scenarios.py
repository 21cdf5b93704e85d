"""What each scenario runs, and how outputs are checked against verispec's plain greedy output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.system import PLAIN, SPEC, Generation
from benchmarks.prompts import Prompt, chat_prompts, extractive_prompt, long_prompt
from benchmarks.report import THROUGHPUT, TTFT

# The TTFT prompt's length: "time to first token on a ~2k-token prompt".
TTFT_PROMPT_TOKENS = 2000


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    prompts: str  # chat, extractive or long: which prompt set (see build_prompts)
    count: int  # prompts submitted at once
    variants: tuple[str, ...] = (PLAIN,)
    verispec_only: bool = False
    logprobs: int | None = None  # verispec SamplingParams.logprobs in the timed runs
    fixed_tokens: int | None = None  # new tokens regardless of --max-tokens (TTFT: 1)
    check_logprobs: bool = False  # untimed verispec run with logprobs=1, compared with HF's
    metric: str = THROUGHPUT
    headline: str = PLAIN  # the verispec variant the other rows are compared with

    def description(self) -> str:
        parts = [f"{self.count} x {self.prompts} prompt", "variants " + "+".join(self.variants)]
        if self.verispec_only:
            parts.append("verispec only")
        if self.logprobs:
            parts.append(f"logprobs={self.logprobs}")
        if self.fixed_tokens:
            parts.append(f"{self.fixed_tokens} new token(s)")
        return ", ".join(parts)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("single", "chat", 1, check_logprobs=True),
    Scenario("batch16", "chat", 16),
    # The cost of logprobs=20 is read against verispec's own batch16 figure from the same run.
    Scenario("batch16_logprobs", "chat", 16, verispec_only=True, logprobs=20),
    # Where prompt lookup pays: every system plain and with its own prompt-lookup drafter.
    Scenario("extractive", "extractive", 1, variants=(PLAIN, SPEC), check_logprobs=True, headline=SPEC),
    Scenario("ttft", "long", 1, fixed_tokens=1, metric=TTFT),
)}
# The speculative sweep (verispec only, its own prompt set): see benchmarks/spec.py.
SPEC_SCENARIO = "spec"
# The adaptive verification sweep (verispec only, by batch size): see benchmarks/adaptive.py.
ADAPTIVE_SCENARIO = "adaptive"
# Prefix caching, cache on against off (verispec only, two HTTP servers): see benchmarks/prefix.py.
PREFIX_SCENARIO = "prefix"
# Structured output's cost, grammar against none (verispec only): see benchmarks/structured.py.
STRUCTURED_SCENARIO = "structured"
# Tensor parallelism's cost on one machine, two ranks against one (verispec only): see benchmarks/scaling.py.
SCALING_SCENARIO = "tp"
COST_SCENARIO = "cost"
# In-place weight updates against a fresh engine (verispec only): see benchmarks/weights.py.
WEIGHTS_SCENARIO = "weights"
# Suffix decoding against prompt lookup and no drafter, three workloads (verispec only): see benchmarks/suffix.py.
SUFFIX_SCENARIO = "suffix"
# DSpark drafting against plain, ngram and suffix on chat (verispec only): see benchmarks/dspark.py.
DSPARK_SCENARIO = "dspark"
# Decode beside a busy process against the quiet machine (verispec, llama-bench): see benchmarks/neighbour.py.
NEIGHBOUR_SCENARIO = "neighbour"
FORMATS_SCENARIO = "formats"  # named only: it writes a 1B model once (benchmarks/formats.py)
SERVING_SCENARIO = "serving"  # named only: verispec serve against llama-server (benchmarks/serving.py)
STARTUP_SCENARIO = "startup"  # named only: its cold row rebuilds the kernels (benchmarks/startup.py)
NAMED_ONLY = (FORMATS_SCENARIO, SERVING_SCENARIO, STARTUP_SCENARIO)
ALL_SCENARIOS = (*SCENARIOS, SPEC_SCENARIO, ADAPTIVE_SCENARIO, PREFIX_SCENARIO, STRUCTURED_SCENARIO, SCALING_SCENARIO,
                 COST_SCENARIO, WEIGHTS_SCENARIO, SUFFIX_SCENARIO, DSPARK_SCENARIO, NEIGHBOUR_SCENARIO)


def headlines() -> dict[str, str]:
    return {s.name: s.headline for s in SCENARIOS.values()}


def build_prompts(tokenizer: Any, scenarios: list[str]) -> dict[str, list[Prompt]]:
    """Prompts per scenario, each set rendered once so every system gets the same token ids."""
    chosen = [SCENARIOS[s] for s in scenarios if s in SCENARIOS]
    out: dict[str, list[Prompt]] = {}
    chat_count = max((s.count for s in chosen if s.prompts == "chat"), default=0)
    chat = chat_prompts(tokenizer, chat_count) if chat_count else []
    for s in chosen:
        if s.prompts == "chat":
            out[s.name] = chat[: s.count]
        elif s.prompts == "extractive":
            out[s.name] = [extractive_prompt(tokenizer)]
        else:
            out[s.name] = [long_prompt(tokenizer, TTFT_PROMPT_TOKENS)]
    return out


def compare(mode: str, gen: Generation, ref: Generation | None, is_reference: bool = False) -> str:
    """'yes'/'no (k/n ...)' against verispec's plain greedy output, or 'n/a' where not comparable."""
    if is_reference:
        return "reference"
    if ref is None:
        return "n/a"
    if mode == "ids" and gen.token_ids is not None and ref.token_ids is not None:
        pairs = list(zip(gen.token_ids, ref.token_ids))
        same = sum(a == b for a, b in pairs)
        if same == len(pairs):
            return "yes (ids)"
        # Where the first mismatch falls tells a near-tie late in the text from a real bug.
        first = min(next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y) for a, b in pairs if a != b)
        return f"no ({same}/{len(pairs)} ids, first diff at token {first})"
    if mode == "text":
        same = sum(a == b for a, b in zip(gen.texts, ref.texts))
        return f"{'yes' if same == len(gen.texts) else 'no'} ({same}/{len(gen.texts)} text)"
    return "n/a"


def max_abs_diff(ours: list[list[float]], theirs: list[list[float]]) -> float:
    """Largest |a - b| over paired logprobs; the lists must have the same shape."""
    if len(ours) != len(theirs) or any(len(a) != len(b) for a, b in zip(ours, theirs)):
        raise ValueError("logprob lists differ in shape")
    return max((abs(a - b) for xs, ys in zip(ours, theirs) for a, b in zip(xs, ys)), default=0.0)
