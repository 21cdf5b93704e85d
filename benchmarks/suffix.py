"""Suffix decoding against prompt lookup and no drafter (verispec only, in process).

Three workloads (benchmarks/workloads.py: an agent's tool-calling loop, a code edit, RL rollouts of
n = 8), each run plain, with ngram (k = 5, lookup 2..4, the extractive scenario's drafter), with
suffix decoding (vLLM's defaults) and with suffix decoding plus adaptive verification, in the exact
and the fast tier. Every timed run gets a fresh engine, so the suffix trees start empty: what they
learn comes from the run itself (earlier sessions and turns, siblings), never from an earlier run of
the same prompts. Reported per row: tok/s (median run), the mean acceptance length (tokens a
verify step emits per drafted request), the share of steps that ran a draft through the forward,
the drafter's host time as a share of the wall time, and whether greedy output equals the plain
row's. The variants take turns within each round (interleaved); `--threads` sets the thread count.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import drafting_steps, write_section
from benchmarks.workloads import agent_sessions, code_edit_messages, rl_messages, sampling

TIERS = {"exact": {"dtype": "float32"}, "fast": {"dtype": "auto"}}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "suffix": {"method": "suffix"},
    "suffix+adaptive": {"method": "suffix", "adaptive_verification": True},
}
WORKLOADS = ("agent", "code_edit", "rl")
AGENT_TURN_TOKENS = 48


@dataclass(slots=True)
class SuffixRow:
    tier: str
    workload: str
    variant: str
    tokens: list[int] = field(default_factory=list)  # per timed run
    seconds: list[float] = field(default_factory=list)
    drafts: int = 0  # verify steps of drafted requests, over the timed runs
    accepted: int = 0
    steps: int = 0
    drafting_steps: int = 0  # steps that ran a draft through the forward
    drafter_s: float = 0.0  # host time in the drafter's propose, over the timed runs
    identical: str = "reference"  # greedy output against the tier's plain row; "sampled" for rl
    memory_bytes: int = 0  # suffix trees at the end of the last run
    global_tokens: int = 0

    @property
    def tok_s(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds)) if self.seconds else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def drafted_share(self) -> float:
        return self.drafting_steps / self.steps if self.steps else 0.0

    @property
    def drafter_share(self) -> float:
        return self.drafter_s / sum(self.seconds) if self.seconds else 0.0


def _timed_propose(drafter, row_ref: list) -> None:
    """Counts the drafter's host time into the row being measured (`row_ref[0]`)."""
    propose = drafter.propose

    def timed(running, rooms):
        start = time.perf_counter()
        proposed = propose(running, rooms)
        if row_ref[0] is not None:
            row_ref[0].drafter_s += time.perf_counter() - start
        return proposed
    drafter.propose = timed


def _agent(llm, sessions: int, turns: int) -> list[list[int]]:
    convs, ids = agent_sessions(sessions), []
    params = sampling("agent", AGENT_TURN_TOKENS)
    for _ in range(turns):
        outs = llm.chat([c.messages for c in convs], params, use_tqdm=False)
        for conv, out in zip(convs, outs):
            conv.answer(out.outputs[0].text)
            ids.append(list(out.outputs[0].token_ids))
    return ids


def _run_workload(llm, workload: str, quick: bool, max_tokens: int) -> list[list[int]]:
    if workload == "agent":
        return _agent(llm, 2 if quick else 4, 2 if quick else 4)
    if workload == "code_edit":
        outs = llm.chat(code_edit_messages(2 if quick else 4), sampling("code", min(2 * max_tokens, 320)),
                        use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    outs = llm.chat(rl_messages(1 if quick else 2), sampling("rl", max_tokens), use_tqdm=False)
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _measure(llm, rows: dict[str, SuffixRow], quick: bool, max_tokens: int, current: list) -> dict[str, list]:
    outputs = {}
    for workload in WORKLOADS:
        row = rows[workload]
        before = llm.stats()
        current[0] = row
        start = time.perf_counter()
        ids = _run_workload(llm, workload, quick, max_tokens)
        row.seconds.append(time.perf_counter() - start)
        current[0] = None
        after = llm.stats()
        row.tokens.append(sum(map(len, ids)))
        row.drafts += after.get("num_drafts", 0) - before.get("num_drafts", 0)
        row.accepted += after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
        row.steps += after.get("num_steps", 0) - before.get("num_steps", 0)
        row.drafting_steps += drafting_steps(before, after)
        outputs[workload] = ids
    return outputs


def _one_run(llm_class, spec, options, rows: dict[str, SuffixRow], quick: bool, max_tokens: int) -> dict[str, list]:
    """One timed run of every workload on a fresh engine (empty trees)."""
    from verispec import SamplingParams

    llm = llm_class(speculative_config=spec, **options)
    llm.generate(["Warm up: count to five."], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    current: list = [None]
    drafter = llm.engine.drafts.drafter if llm.engine.drafts is not None else None
    if drafter is not None:
        _timed_propose(drafter, current)
    outputs = _measure(llm, rows, quick, max_tokens, current)
    if hasattr(drafter, "cache"):
        stats = drafter.cache.stats()
        for row in rows.values():
            row.memory_bytes, row.global_tokens = stats.memory_bytes, stats.global_tokens
    llm.shutdown()
    return outputs


def run_suffix(quick: bool, max_tokens: int, runs: int, log: Callable[[str], None]) -> list[SuffixRow]:
    from verispec import LLM

    rows: list[SuffixRow] = []
    for tier, options in TIERS.items():
        by_variant = {v: {w: SuffixRow(tier, w, v) for w in WORKLOADS} for v in VARIANTS}
        outputs: dict[str, dict[str, list]] = {}
        # The variants take turns within each round: a slow spell of this shared VM (single runs
        # of one configuration spread by 40 %) then hits every variant alike.
        for _ in range(runs):
            for variant, spec in VARIANTS.items():
                outputs[variant] = _one_run(LLM, spec, options, by_variant[variant], quick, max_tokens)
        for variant, by_workload in by_variant.items():
            for w, row in by_workload.items():
                if variant != "plain":
                    row.identical = "sampled" if w == "rl" else (
                        "yes" if outputs[variant][w] == outputs["plain"][w] else "NO")
                log(f"  {tier} {w} {variant}: {row.tok_s:.1f} tok/s, acceptance {row.acceptance_length:.2f}, "
                    f"drafter {row.drafter_share:.1%}, drafted on {row.drafted_share:.0%} of steps")
            rows.extend(by_workload.values())
    return rows


# ------------------------------------------------------------------------------ targets and report
@dataclass(slots=True)
class SuffixTarget:
    name: str
    ratio: float
    bound: float
    at_most: bool = False  # a ceiling (host time), not a floor

    @property
    def met(self) -> bool:
        return self.ratio <= self.bound if self.at_most else self.ratio >= self.bound


def targets(rows: list[SuffixRow]) -> list[SuffixTarget]:
    """The issue's targets, from one run's rows."""
    tok = {(r.tier, r.workload, r.variant): r.tok_s for r in rows}

    def ratio(tier, workload, a, b):
        return tok.get((tier, workload, a), 0.0) / tok[(tier, workload, b)] if tok.get((tier, workload, b)) else 0.0

    out = []
    for tier in TIERS:
        for w in ("agent", "code_edit"):
            out.append(SuffixTarget(f"{tier} {w}: suffix / ngram", ratio(tier, w, "suffix", "ngram"), 1.3))
        out.append(SuffixTarget(f"{tier} rl n=8: suffix / plain", ratio(tier, "rl", "suffix", "plain"), 1.5))
        for w in WORKLOADS:
            out.append(SuffixTarget(f"{tier} {w}: suffix+adaptive / plain", ratio(tier, w, "suffix+adaptive", "plain"),
                                    0.97))
    for w in ("agent", "code_edit"):
        out.append(SuffixTarget(f"exact {w}: suffix / plain", ratio("exact", w, "suffix", "plain"), 2.0))
    for r in rows:
        if r.workload == "rl" and r.variant.startswith("suffix"):
            out.append(SuffixTarget(f"{r.tier} rl {r.variant}: drafter host time / wall (batch 16)",
                                    r.drafter_share, 0.05, at_most=True))
    return out


def format_suffix(rows: list[SuffixRow]) -> str:
    lines = ["| tier | workload | variant | tok/s | vs plain | acceptance length | steps drafted | drafter host | "
             "greedy = plain |", "|---|---|---|---|---|---|---|---|---|"]
    plain = {(r.tier, r.workload): r.tok_s for r in rows if r.variant == "plain"}
    for r in rows:
        base = plain.get((r.tier, r.workload)) or 0.0
        vs = f"{r.tok_s / base:.2f}x" if base else "n/a"
        host = f"{r.drafter_share:.1%}" if r.variant != "plain" else "-"
        lines.append(f"| {r.tier} | {r.workload} | {r.variant} | {r.tok_s:.1f} | {vs} | {r.acceptance_length:.2f} | "
                     f"{r.drafted_share:.0%} | {host} | {r.identical} |")
    lines += ["", "| target | ratio | bound | met |", "|---|---|---|---|"]
    for t in targets(rows):
        bound = f"<= {t.bound:.0%}" if t.at_most else f">= {t.bound}x"
        shown = f"{t.ratio:.1%}" if t.at_most else f"{t.ratio:.2f}x"
        lines.append(f"| {t.name} | {shown} | {bound} | {'yes' if t.met else 'NO'} |")
    mem = [r for r in rows if r.global_tokens]
    if mem:
        worst = max(mem, key=lambda r: r.memory_bytes / r.global_tokens)
        lines += ["", f"Suffix trees at the end of a run: {worst.memory_bytes / 1024:.0f} KiB for "
                      f"{worst.global_tokens} tokens in the global trees "
                      f"({worst.memory_bytes / worst.global_tokens:.0f} bytes per token, per-request trees included)."]
    return "\n".join(lines)


def plot_suffix(path: Path, rows: list[SuffixRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TIERS), figsize=(11, 4), sharey=True)
    for ax, tier in zip(axes, TIERS):
        for i, variant in enumerate(VARIANTS):
            xs = [j + 0.2 * (i - 1.5) for j in range(len(WORKLOADS))]
            ys = [next((r.tok_s for r in rows if (r.tier, r.workload, r.variant) == (tier, w, variant)), 0.0)
                  for w in WORKLOADS]
            ax.bar(xs, ys, width=0.2, label=variant)
        ax.set_xticks(range(len(WORKLOADS)), WORKLOADS)
        ax.set_title(f"{tier} tier")
    axes[0].set_ylabel("tokens / s")
    axes[0].legend()
    fig.suptitle("verispec suffix decoding (SmolLM2-135M, 2 vCPUs; fresh trees every run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_suffix(out: Path, machine: dict[str, Any], rows: list[SuffixRow]) -> str:
    plot_suffix(out / "suffix.png", rows)
    doc = {"machine": machine, "rows": [{**asdict(r), "tok_s": r.tok_s, "acceptance_length": r.acceptance_length,
                                         "drafter_share": r.drafter_share, "drafted_share": r.drafted_share} for r in rows],
           "targets": [{**asdict(t), "met": t.met} for t in targets(rows)]}
    return write_section(out, "suffix", format_suffix(rows), doc)
