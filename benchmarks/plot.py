"""bench.png: tok/s per system and scenario, with a second panel for time to first token."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.system import PLAIN
from benchmarks.report import THROUGHPUT, TTFT, Result


def _panel(ax: Any, rows: list[Result], colors: dict[str, Any], ttft: bool) -> None:
    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    for j, scenario in enumerate(scenarios):
        # Each group holds only the rows that ran in it (the speculative variants appear in one
        # scenario only), centred on its tick, so no group is full of empty slots.
        group = [r for r in rows if r.scenario == scenario]
        width = 0.8 / max(len(group), 3)
        for i, r in enumerate(group):
            vals = r.ttft_ms if ttft else r.tok_s
            mid = statistics.median(vals)
            x = j + (i - (len(group) - 1) / 2) * width
            bar = ax.bar([x], [mid], width, yerr=[[mid - min(vals)], [max(vals) - mid]], capsize=3,
                         color=colors[r.label], label=r.label)
            if r.busy:  # measured while other processes took CPU: show it, don't hide it
                bar[0].set_hatch("//")
            ax.bar_label(bar, fmt=lambda v: f"{v:.0f}" if v >= 10 else f"{v:.1f}", padding=2, fontsize=7)
    names = [f"{s}\n({max(r.prompt_tokens for r in rows if r.scenario == s)}-token prompt)" if ttft else s
             for s in scenarios]
    ax.set_xticks(range(len(scenarios)), names)
    ax.set_ylabel("time to first token, ms (lower is better)" if ttft else
                  "generated tokens / s (median, min-max)")


def series_colors(rows: list[Result], cmap: Any) -> dict[str, Any]:
    """A hue per system (each verispec tier its own), dark for plain and light for speculative.

    tab20 lists its colours in (dark, light) pairs, so system i gets pair i: the two tiers and
    the peers stay apart at a glance, and a system's prompt-lookup bar sits next to its own hue.
    """
    systems = list(dict.fromkeys(r.system for r in rows))
    return {r.label: cmap((2 * systems.index(r.system) + (r.variant != PLAIN)) % 20) for r in rows}


def plot(path: Path, results: list[Result], machine: dict[str, Any], max_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to the PNG
    import matplotlib.pyplot as plt

    done = [r for r in results if r.tokens]
    through = [r for r in done if r.metric == THROUGHPUT]
    ttft = [r for r in done if r.metric == TTFT]
    labels = list(dict.fromkeys(r.label for r in done))
    colors = series_colors(done, plt.get_cmap("tab20"))
    panels = [p for p in ((through, False), (ttft, True)) if p[0]]
    # Panel widths follow their scenario counts, so bars come out about as wide in both.
    ratios = [max(1.2, len({r.scenario for r in rows}) * (1.0 if is_ttft else 1.3)) for rows, is_ttft in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(2 + 2.4 * sum(ratios), 5), dpi=120,
                             gridspec_kw={"width_ratios": ratios}, squeeze=False)
    for ax, (rows, is_ttft) in zip(axes[0], panels):
        _panel(ax, rows, colors, is_ttft)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[label]) for label in labels]
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    note = " (hatched: other processes were busy)" if any(r.busy for r in done) else ""
    fig.suptitle(
        f"SmolLM2-135M-Instruct, greedy, {max_tokens} new tokens (TTFT: 1)\n"
        f"{machine['cpu']}, {machine['torch_threads']} threads{note}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path)
    plt.close(fig)
