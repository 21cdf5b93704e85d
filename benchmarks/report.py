"""Benchmark results: the Result rows, ratios, the stdout/Markdown tables and bench.json."""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

# Above this many cores used by other processes during a run, the table marks the figure "busy".
BUSY_CORES = 0.25
THROUGHPUT, TTFT = "tok/s", "ttft"


@dataclass(slots=True)
class Result:
    """One system (in one variant) on one scenario: `runs` timed runs after an untimed warm-up."""

    system: str  # key: verispec, hf, llamacpp
    label: str  # e.g. "verispec + ngram k=5"
    scenario: str
    prompts: int
    max_tokens: int
    variant: str = "plain"  # plain or spec
    metric: str = THROUGHPUT  # tok/s, or ttft (time to the first token; max_tokens is 1)
    prompt_tokens: int = 0  # tokens in the longest prompt
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens produced in each run
    equal: str = "n/a"  # same greedy output as verispec's plain run: reference / yes / no (k/n) / n/a
    short: int = 0  # prompts that produced fewer than max_tokens tokens (should stay 0)
    # Speculative variants, summed over the timed runs: verify steps that carried a draft and the
    # tokens they emitted. None where the system is not speculating or does not say.
    spec_steps: int | None = None
    spec_tokens: int | None = None
    # verispec rows: max |logprob - HF's log_softmax| over the generated tokens (untimed check run).
    logprob_diff: float | None = None
    # CPU cores other processes kept busy during each run; on a small machine even one busy core
    # slows torch's thread pool by far more than its share, so a high value marks a suspect figure.
    others_load: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds)]

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)

    @property
    def ttft_ms(self) -> list[float]:
        return [1000.0 * s for s in self.seconds]

    @property
    def acceptance(self) -> float | None:
        """Mean acceptance length: tokens per verify step that carried a draft."""
        if self.spec_steps is None or self.spec_tokens is None:
            return None
        return self.spec_tokens / self.spec_steps if self.spec_steps else 1.0

    @property
    def busy(self) -> bool:
        return bool(self.others_load) and max(self.others_load) > BUSY_CORES

    def score(self) -> float:
        """The figure compared across systems, larger = better: median tok/s, or 1/median TTFT."""
        if self.metric == TTFT:
            return 1.0 / statistics.median(self.seconds)
        return self.median

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        rates = self.tok_s
        out.update(tok_s_median=self.median, tok_s_min=min(rates), tok_s_max=max(rates), tok_s_runs=rates,
                   mean_acceptance_length=self.acceptance)
        if self.metric == TTFT:
            ms = self.ttft_ms
            out.update(ttft_ms_median=statistics.median(ms), ttft_ms_min=min(ms), ttft_ms_max=max(ms))
        return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "llamacpp_threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "llama_cpp": _version("llama_cpp_python"),
            "verispec": _version("verispec"),
        },
    }


def ratios(results: list[Result], headline: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """Per scenario, verispec's headline row over every other row (>1: verispec is better).

    The headline is verispec's plain row, or the variant named in `headline` for that scenario
    (the speculative one where the scenario is about speculation). For TTFT the ratio is the
    row's time over verispec's, so >1 still means verispec is better.
    """
    headline = headline or {}
    ref = {r.scenario: r for r in results
           if r.system == "verispec" and r.tokens and r.variant == headline.get(r.scenario, "plain")}
    out: dict[str, dict[str, float]] = {}
    for r in results:
        base = ref.get(r.scenario)
        if base is not None and r.tokens and r is not base:
            out.setdefault(r.scenario, {})[r.label] = base.score() / r.score()
    return out


def _load_cell(r: Result) -> str:
    return f"{max(r.others_load):.2f}" + (" (busy)" if r.busy else "") if r.others_load else "?"


def _render(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows])


def format_table(results: list[Result], markdown: bool = False, headline: dict[str, str] | None = None) -> str:
    """Throughput rows (every scenario but TTFT)."""
    rel = ratios(results, headline)
    head = ["scenario", "system", "tok/s", "min", "max", "verispec / system", "same output as verispec",
            "mean acceptance length", "max abs logprob diff vs HF", "other load"]
    rows = []
    for r in results:
        if not r.tokens or r.metric != THROUGHPUT:
            continue
        rates = r.tok_s
        ratio = rel.get(r.scenario, {}).get(r.label)
        rows.append([
            r.scenario,
            r.label,
            f"{r.median:.1f}",
            f"{min(rates):.1f}",
            f"{max(rates):.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            r.equal + (f", {r.short} short" if r.short else ""),
            "-" if r.acceptance is None else f"{r.acceptance:.2f}",
            "-" if r.logprob_diff is None else f"{r.logprob_diff:.1e}",
            _load_cell(r),
        ])
    return _render(head, rows, markdown)


def format_ttft_table(results: list[Result], markdown: bool = False) -> str:
    """Time-to-first-token rows; empty string if the scenario did not run."""
    rel = ratios(results)
    head = ["system", "prompt tokens", "TTFT ms", "min", "max", "prefill tok/s", "system TTFT / verispec TTFT",
            "same first token as verispec", "other load"]
    rows = []
    for r in results:
        if not r.tokens or r.metric != TTFT:
            continue
        ms = r.ttft_ms
        ratio = rel.get(r.scenario, {}).get(r.label)
        median_ms = statistics.median(ms)
        rows.append([
            r.label,
            str(r.prompt_tokens),
            f"{median_ms:.0f}",
            f"{min(ms):.0f}",
            f"{max(ms):.0f}",
            f"{r.prompt_tokens / (median_ms / 1000):.0f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            r.equal,
            _load_cell(r),
        ])
    return _render(head, rows, markdown) if rows else ""


def format_ratios(results: list[Result], headline: dict[str, str] | None = None) -> str:
    labels = {(r.scenario, r.variant): r.label for r in results if r.system == "verispec"}
    lines = []
    for scenario, per_row in ratios(results, headline).items():
        ref = labels.get((scenario, (headline or {}).get(scenario, "plain")), "verispec")
        parts = [f"{ref} / {label} = {v:.2f}x" for label, v in per_row.items()]
        lines.append(f"{scenario}: " + ", ".join(parts))
    return "\n".join(lines)


def write_section(out: Path, stem: str, md: str, doc: dict[str, Any]) -> str:
    """A verispec-only scenario's table as `stem`.md and its figures as `stem`.json under `out`;
    returns the Markdown for stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(md + "\n")
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2))
    return md


def write_json(path: Path, doc: dict[str, Any], results: list[Result], headline: dict[str, str]) -> None:
    doc = {
        **doc,
        "results": [r.to_json() for r in results if r.tokens],
        "ratios_verispec_over_row": ratios(results, headline),
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def busy_seconds() -> float | None:
    """CPU seconds all processes have used so far (from /proc/stat); None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def self_seconds() -> float:
    """CPU seconds this process has used so far."""
    t = os.times()
    return t.user + t.system


def drafting_steps(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Steps between two `LLM.stats()` that ran a draft through the forward: adaptive verification
    counts them; without it every step of an engine that drafted at all did."""
    if "adaptive" in after:
        return after["adaptive"]["drafting_steps"] - before["adaptive"]["drafting_steps"]
    if after.get("num_drafts", 0) > before.get("num_drafts", 0):
        return after["num_steps"] - before["num_steps"]
    return 0
