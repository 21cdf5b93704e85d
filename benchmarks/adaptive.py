"""Adaptive verification sweep: fixed draft lengths k against the adaptive budget, by batch size.

A fixed k is a bet on one acceptance rate: large k pays on extractive requests and wastes verify
rows on the rest, and the waste grows with the batch (each rejected row is a real token of the
forward). Adaptive verification picks the step's budget and each request's share from a profiled
cost model, so it should track the best fixed k at every batch size without knowing it. Batches
mix high- and low-acceptance requests, which is where one k for all is at its worst.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import BUSY_CORES, busy_seconds, self_seconds
from benchmarks.spec import CATEGORIES
from benchmarks.texts import REPORT
from benchmarks.tiers import FAST

Conversation = list[dict[str, str]]

ADAPTIVE = "adaptive k=6"
# ngram with the default lookup (2..4); "none" is the reference every other output must equal.
CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    **{f"k={k}": {"method": "ngram", "num_speculative_tokens": k} for k in (1, 2, 4, 6)},
    ADAPTIVE: {"method": "ngram", "num_speculative_tokens": 6, "adaptive_verification": True},
}
BATCH_SIZES = (1, 4, 16, 32)
# --quick keeps the two ends of the fixed-k range: enough to see adaptive against both bets.
QUICK_CONFIGS = ("none", "k=1", "k=6", ADAPTIVE)
QUICK_BATCH_SIZES = (1, 4)
# Target: at least as fast as the best fixed k (which one is best is unknown in advance) at every
# batch size, and strictly better somewhere (else a fixed k would do).
TARGET_RATIO = 1.0
TARGET = (f"adaptive >= {TARGET_RATIO}x the best fixed k at every batch size, "
          "and beats every fixed k at some batch size")

# High acceptance: the answer copies the prompt (summaries, quoting documents, rewrites).
_REWRITES: list[Conversation] = [
    [{"role": "user", "content": f"Rewrite this paragraph for a newsletter, keeping its facts and "
                                 f"wording:\n\n{REPORT[i]}"}] for i in (1, 2)
]
HIGH: list[Conversation] = [*CATEGORIES["summarization"], *CATEGORIES["rag"], *_REWRITES]
# Low acceptance: the answer is new text, so ngram drafts rarely match.
LOW: list[Conversation] = [c for cat in ("qa", "translation", "math", "multi_turn") for c in CATEGORIES[cat]]
# Alternating, so every batch of two or more mixes both kinds; a fixed list, so runs compare.
POOL: list[Conversation] = [c for pair in zip(HIGH, LOW) for c in pair] + HIGH[len(LOW):] + LOW[len(HIGH):]


def batch_of(size: int) -> list[Conversation]:
    """The first `size` conversations of the pool, cycling (batch 32 repeats some prompts)."""
    return [POOL[i % len(POOL)] for i in range(size)]


@dataclass(slots=True)
class AdaptiveRow:
    batch_size: int
    config: str
    tokens: list[int] = field(default_factory=list)  # per timed run
    seconds: list[float] = field(default_factory=list)
    drafts: int = 0  # summed over the timed runs
    accepted: int = 0
    identical: bool = True  # every run's token ids equal "none"'s
    # Adaptive only (None otherwise): engine counters' deltas over the timed runs.
    steps: int | None = None
    admitted: int | None = None
    capacity_histogram: list[int] | None = None
    # Cores other processes kept busy, worst run: on 2 cores one busy neighbour stalls torch's
    # thread pool far beyond its share, so such a figure is suspect (report.BUSY_CORES).
    others_load: float = 0.0

    @property
    def busy(self) -> bool:
        return self.others_load > BUSY_CORES

    @property
    def tok_s(self) -> float:
        # The median run: one slow run (a neighbour's burst on a shared VM) does not move it.
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds)) if self.seconds else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def mean_admitted_per_step(self) -> float | None:
        if self.steps is None or self.admitted is None:
            return None
        return self.admitted / self.steps if self.steps else 0.0


@dataclass(slots=True)
class Summary:
    batch_size: int
    best_fixed: str
    best_fixed_tok_s: float
    adaptive_tok_s: float
    busy: bool = False  # either row was measured while other processes took CPU

    @property
    def ratio(self) -> float:
        return self.adaptive_tok_s / self.best_fixed_tok_s if self.best_fixed_tok_s else 0.0

    @property
    def beats_all(self) -> bool:
        return self.adaptive_tok_s > self.best_fixed_tok_s


def _run_once(llm: Any, convs: list[Conversation], params: Any, row: AdaptiveRow) -> list[list[int]]:
    before = llm.stats()
    llm.reset_prefix_cache()  # every run and configuration computes its prompts in full
    busy, mine, start = busy_seconds(), self_seconds(), time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after_busy = busy_seconds()
    row.seconds.append(wall)
    if busy is not None and after_busy is not None:
        row.others_load = max(row.others_load, (after_busy - busy - (self_seconds() - mine)) / wall)
    after = llm.stats()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    row.tokens.append(sum(len(i) for i in ids))
    row.drafts += after.get("num_drafts", 0) - before.get("num_drafts", 0)
    row.accepted += after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    if "adaptive" in after:
        a, b = after["adaptive"], before["adaptive"]
        row.steps = (row.steps or 0) + a["num_steps"] - b["num_steps"]
        row.admitted = (row.admitted or 0) + a["admitted_total"] - b["admitted_total"]
        delta = [x - y for x, y in zip(a["capacity_histogram"], b["capacity_histogram"])]
        row.capacity_histogram = [x + y for x, y in zip(row.capacity_histogram or [0] * len(delta), delta)]
    return ids


def run_adaptive(max_tokens: int, runs: int, quick: bool, log: Callable[[str], None],
                 loaded: dict[str, Any] | None = None, queue: int = 1) -> list[AdaptiveRow]:
    """Per batch size and run, every configuration back to back, so drift in machine speed hits
    all of them alike. `loaded` maps configuration names to engines already built that way (the
    bench's plain engine is "none"), which saves their load time.

    queue > 1 measures serving instead of one batch: queue x batch requests are submitted and at
    most `batch` run at once, a finished one's slot going to the next (continuous batching). A
    fixed batch lasts as long as its slowest request, so drafts that finish fast requests sooner
    buy nothing there; in serving they free a slot for the next request."""
    from verispec import LLM, SamplingParams

    names = list(QUICK_CONFIGS if quick else CONFIGS)
    sizes = QUICK_BATCH_SIZES if quick else BATCH_SIZES
    loaded = loaded or {}
    # One engine per configuration for all batch sizes: loading (and profiling the cost model)
    # costs seconds. The default KV pool holds batch 32 at the bench's lengths. The default (fast)
    # tier, whose cost curve the budget is chosen on, named explicitly so LLM()'s default dtype
    # cannot change what the sweep measures.
    engines = {n: loaded.get(n) or LLM(dtype=FAST.dtype, speculative_config=CONFIGS[n],
                                       max_num_seqs=max(64, max(sizes)))
               for n in names}
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    for llm in engines.values():
        llm.chat(batch_of(4), warm, use_tqdm=False)  # untimed: batched prefill, decode, verify
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows: list[AdaptiveRow] = []
    for size in sizes:
        convs = batch_of(size * queue)
        for llm in engines.values():  # concurrency cap for this batch size
            llm.engine.scheduler.max_num_seqs = size if queue > 1 else max(64, max(sizes))
        by_name = {n: AdaptiveRow(size, n) for n in names}
        for _ in range(runs):
            ref: list[list[int]] | None = None
            for n in names:  # "none" first: the reference for this run
                ids = _run_once(engines[n], convs, params, by_name[n])
                ref = ids if ref is None else ref
                by_name[n].identical &= ids == ref
        for n in names:
            row = by_name[n]
            rows.append(row)
            extra = (f", admitted/step {row.mean_admitted_per_step:.1f}, capacities {row.capacity_histogram}"
                     if row.steps is not None else "")
            extra += f", other processes used {row.others_load:.2f} cores" if row.busy else ""
            log(f"  adaptive sweep batch {size:>2} {n:>12}: {row.tok_s:6.1f} tok/s, acceptance length "
                f"{row.mean_acceptance_length:.2f}, identical {row.identical}{extra}")
    engines.clear()
    return rows


def summarize(rows: list[AdaptiveRow]) -> list[Summary]:
    """Per batch size: the best fixed k (by tok/s) against adaptive; sizes missing either are left out."""
    out = []
    for size in dict.fromkeys(r.batch_size for r in rows):
        fixed = [r for r in rows if r.batch_size == size and r.config.startswith("k=")]
        adaptive = next((r for r in rows if r.batch_size == size and r.config == ADAPTIVE), None)
        if fixed and adaptive is not None:
            best = max(fixed, key=lambda r: r.tok_s)
            out.append(Summary(size, best.config, best.tok_s, adaptive.tok_s, best.busy or adaptive.busy))
    return out


def target_met(summaries: list[Summary]) -> bool:
    return bool(summaries) and all(s.ratio >= TARGET_RATIO for s in summaries) and any(s.beats_all for s in summaries)


def format_adaptive_table(rows: list[AdaptiveRow]) -> str:
    base = {r.batch_size: r.tok_s for r in rows if r.config == "none"}
    lines = [("| batch | configuration | tok/s | speed-up vs none | mean acceptance length "
              "| admitted drafts/step | identical to none |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = r.tok_s / base[r.batch_size] if base.get(r.batch_size) else 0.0
        admitted = "-" if r.mean_admitted_per_step is None else f"{r.mean_admitted_per_step:.1f}"
        lines.append(f"| {r.batch_size} | {r.config} | {r.tok_s:.1f}{' (busy)' if r.busy else ''} | {speedup:.2f}x | "
                     f"{r.mean_acceptance_length:.2f} | {admitted} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)


def format_summary(summaries: list[Summary]) -> str:
    lines = ["| batch | best fixed k | its tok/s | adaptive tok/s | adaptive / best fixed k | beats every fixed k |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {s.batch_size} | {s.best_fixed} | {s.best_fixed_tok_s:.1f} | {s.adaptive_tok_s:.1f} | "
              f"{s.ratio:.2f}x{' (busy)' if s.busy else ''} | {'yes' if s.beats_all else 'no'} |"
              for s in summaries]
    verdict = ("met" if target_met(summaries) else "missed") + (" (busy)" if any(s.busy for s in summaries) else "")
    return "\n".join(lines) + f"\n\nTarget: {TARGET}: **{verdict}**."


def adaptive_json(rows: list[AdaptiveRow]) -> list[dict[str, Any]]:
    return [{"batch_size": r.batch_size, "config": r.config, "spec": CONFIGS.get(r.config),
             "tokens": r.tokens, "seconds": r.seconds, "tok_s": r.tok_s,
             "mean_acceptance_length": r.mean_acceptance_length, "identical_to_none": r.identical,
             "adaptive_steps": r.steps, "mean_admitted_per_step": r.mean_admitted_per_step,
             "capacity_histogram": r.capacity_histogram, "others_load": r.others_load} for r in rows]


def summary_json(summaries: list[Summary]) -> list[dict[str, Any]]:
    return [{"batch_size": s.batch_size, "best_fixed": s.best_fixed, "best_fixed_tok_s": s.best_fixed_tok_s,
             "adaptive_tok_s": s.adaptive_tok_s, "ratio": s.ratio, "beats_every_fixed_k": s.beats_all, "busy": s.busy}
            for s in summaries]


def plot_adaptive(path: Path, rows: list[AdaptiveRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in dict.fromkeys(r.config for r in rows):
        mine = sorted((r.batch_size, r.tok_s) for r in rows if r.config == name)
        style = {"linewidth": 2.5, "color": "black"} if name == ADAPTIVE else {"linestyle": "--" if name == "none" else "-"}
        ax.plot([b for b, _ in mine], [t for _, t in mine], marker="o", label=name, **style)
    sizes = sorted({r.batch_size for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size (mixed high/low acceptance prompts)")
    ax.set_ylabel("tok/s")
    ax.set_title("verispec adaptive verification vs fixed k (SmolLM2-135M fp32, greedy, ngram)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_adaptive(out: Path, machine: dict[str, Any], rows: list[AdaptiveRow], max_tokens: int, runs: int,
                   queue: int) -> str:
    """adaptive.md, adaptive.json and adaptive.png under `out`; returns the Markdown for stdout."""
    summaries = summarize(rows)
    md = format_adaptive_table(rows) + "\n\n" + format_summary(summaries)
    if queue > 1:
        md = (f"Serving: {queue} x batch requests per batch size, at most `batch` "
              "running at once (continuous batching).\n\n" + md)
    (out / "adaptive.md").write_text(md + "\n")
    (out / "adaptive.json").write_text(json.dumps(
        {"machine": machine, "max_tokens": max_tokens, "runs": runs, "queue": queue, "rows": adaptive_json(rows),
         "summary": summary_json(summaries), "target_met": target_met(summaries)}, indent=2))
    plot_adaptive(out / "adaptive.png", rows)
    return md
