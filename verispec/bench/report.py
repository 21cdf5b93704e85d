"""Benchmark results: the dataclasses, the stdout table, bench.json and the bench.png chart."""

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


@dataclass(slots=True)
class Result:
    """One system on one scenario: `runs` timed runs after an untimed warm-up."""

    system: str  # key: verispec, hf, llamacpp
    label: str
    scenario: str
    prompts: int
    max_tokens: int
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens produced in each run
    equal: str = "n/a"  # same greedy output as verispec: reference / yes / no (k/n) / n/a
    short: int = 0  # prompts that produced fewer than max_tokens tokens (should stay 0)
    # CPU cores other processes kept busy during each run; on a small machine even one busy core
    # slows torch's thread pool by far more than its share, so a high value marks a suspect figure.
    others_load: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds)]

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        rates = self.tok_s
        out.update(tok_s_median=self.median, tok_s_min=min(rates), tok_s_max=max(rates), tok_s_runs=rates)
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


def ratios(results: list[Result]) -> dict[str, dict[str, float]]:
    """verispec's median tok/s divided by each peer's, per scenario (>1: verispec is faster)."""
    out: dict[str, dict[str, float]] = {}
    ref = {r.scenario: r.median for r in results if r.system == "verispec" and r.tokens}
    for r in results:
        if r.system != "verispec" and r.tokens and r.scenario in ref:
            out.setdefault(r.scenario, {})[r.system] = ref[r.scenario] / r.median
    return out


def format_table(results: list[Result], markdown: bool = False) -> str:
    rel = ratios(results)
    head = ["scenario", "system", "tok/s", "min", "max", "verispec / system", "same output as verispec", "other load"]
    rows = []
    for r in results:
        if not r.tokens:
            continue
        rates = r.tok_s
        ratio = rel.get(r.scenario, {}).get(r.system)
        rows.append([
            r.scenario,
            r.label,
            f"{r.median:.1f}",
            f"{min(rates):.1f}",
            f"{max(rates):.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            r.equal + (f", {r.short} short" if r.short else ""),
            f"{max(r.others_load):.2f}" + (" (busy)" if max(r.others_load) > BUSY_CORES else "") if r.others_load else "?",
        ])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows])


def format_ratios(results: list[Result]) -> str:
    labels = {r.system: r.label for r in results}
    lines = []
    for scenario, per_peer in ratios(results).items():
        parts = [f"verispec/{labels[k]} = {v:.2f}x" for k, v in per_peer.items()]
        lines.append(f"{scenario}: " + ", ".join(parts))
    return "\n".join(lines)


def write_json(path: Path, machine: dict[str, Any], config: dict[str, Any], results: list[Result],
               skipped: dict[str, str], errors: dict[str, str]) -> None:
    doc = {
        "machine": machine,
        "config": config,
        "results": [r.to_json() for r in results if r.tokens],
        "ratios_verispec_over_peer": ratios(results),
        "skipped": skipped,
        "errors": errors,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def plot(path: Path, results: list[Result], machine: dict[str, Any], max_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to the PNG
    import matplotlib.pyplot as plt

    done = [r for r in results if r.tokens]
    scenarios = list(dict.fromkeys(r.scenario for r in done))
    systems = list(dict.fromkeys(r.system for r in done))
    labels = {r.system: r.label for r in done}
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for i, system in enumerate(systems):
        xs, ys, lo, hi, busy = [], [], [], [], []
        for j, scenario in enumerate(scenarios):
            r = next((r for r in done if r.system == system and r.scenario == scenario), None)
            if r is None:
                continue
            rates = r.tok_s
            xs.append(j + (i - (len(systems) - 1) / 2) * width)
            ys.append(r.median)
            lo.append(r.median - min(rates))
            hi.append(max(rates) - r.median)
            busy.append(bool(r.others_load) and max(r.others_load) > BUSY_CORES)
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=labels[system])
        for bar, suspect in zip(bars, busy):
            if suspect:  # measured while other processes took CPU: show it, don't hide it
                bar.set_hatch("//")
        ax.bar_label(bars, fmt=lambda v: f"{v:.0f}" if v >= 10 else f"{v:.1f}", padding=2, fontsize=8)
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_ylabel("generated tokens / s (median, min-max)")
    note = ""
    if any(r.others_load and max(r.others_load) > BUSY_CORES for r in done):
        note = " (hatched: other processes were busy)"
    ax.set_title(
        f"SmolLM2-135M-Instruct, greedy, {max_tokens} new tokens\n"
        f"{machine['cpu']}, {machine['torch_threads']} threads{note}",
        fontsize=9,
    )
    for handle in ax.legend().legend_handles:
        handle.set_hatch("")  # the legend shows systems; hatching is per bar
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
