"""Tensor parallelism's cost on one machine (verispec only, in process, the bundled model).

Two ranks on the same CPU cores cannot be faster than one: the point of the figures is what
the split costs, not a speed-up. For each tier (exact fp32, fast bf16 on the GGUF codes) and
batch size, the median decode step of:
- one rank as users get it (the compiled step where the tier has one),
- one rank eager (the same code path the ranks run),
- two ranks (gloo, eager: collectives stay outside the compiled graph),
and the bytes the step moves between ranks: all-reduced (each rank's payload), gathered
(logit blocks into rank 0), broadcast (ids and hidden rows from rank 0), op messages.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.prompts import chat_prompts
from benchmarks.report import write_section

TIERS = {"exact fp32": {"dtype": "float32"}, "fast bf16": {"dtype": "auto"}}
_COUNTERS = ("bytes_reduced", "bytes_gathered", "bytes_broadcast", "bytes_control")


@dataclass(slots=True)
class ScalingRow:
    tier: str
    batch: int
    tp1_ms: float  # one rank, as configured by default (compiled where it can be)
    tp1_eager_ms: float
    tp2_ms: float
    reduced_kib: float  # per step
    gathered_kib: float
    broadcast_kib: float
    control_kib: float

    @property
    def ratio(self) -> float:
        """Two ranks' step against one eager rank's (the same code path)."""
        return self.tp2_ms / self.tp1_eager_ms if self.tp1_eager_ms else 0.0


def _decode_steps(llm: Any, prompts: list[list[int]], steps: int) -> tuple[float, dict[str, float]]:
    """Median ms of `steps` decode steps once every prompt is prefilled, and bytes moved per step."""
    from verispec import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"scaling-{i}", p, params)
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    group = eng.tp.group if eng.tp is not None else None
    before = {k: getattr(group, k) for k in _COUNTERS} if group else {}
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    moved = {k: (getattr(group, k) - before[k]) / steps for k in _COUNTERS} if group else {}
    for i in range(len(prompts)):
        eng.abort_request(f"scaling-{i}")
    return statistics.median(times) * 1e3, moved


def run_scaling(tokenizer: Any, quick: bool, log: Callable[[str], None]) -> list[ScalingRow]:
    import torch

    from verispec import LLM

    # Rank 0 of a two-rank engine takes half the threads (its worker has the other half); every
    # engine here starts from the run's own count.
    threads = torch.get_num_threads()
    batches = (1, 16)
    steps = 8 if quick else 32
    prompts = [p.ids for p in chat_prompts(tokenizer, max(batches))]
    rows = []
    for tier, kw in TIERS.items():
        ms: dict[tuple[str, int], float] = {}
        moved: dict[int, dict[str, float]] = {}
        for label, extra in (("tp1", {}), ("tp1_eager", {"enforce_eager": True}), ("tp2", {"tensor_parallel_size": 2})):
            torch.set_num_threads(threads)
            llm = LLM(num_kv_blocks=512, **kw, **extra)
            try:
                _decode_steps(llm, prompts[:1], 2)  # warm-up
                for b in batches:
                    ms[label, b], m = _decode_steps(llm, prompts[:b], steps)
                    if m:
                        moved[b] = m
                    log(f"scaling {tier} {label} batch {b}: {ms[label, b]:.1f} ms/step")
            finally:
                llm.shutdown()
        for b in batches:
            m = {k: v / 1024 for k, v in moved[b].items()}
            rows.append(ScalingRow(tier, b, ms["tp1", b], ms["tp1_eager", b], ms["tp2", b], m["bytes_reduced"],
                                   m["bytes_gathered"], m["bytes_broadcast"], m["bytes_control"]))
    torch.set_num_threads(threads)
    return rows


def format_scaling_table(rows: list[ScalingRow]) -> str:
    head = ("| tier | batch | TP=1 (default) ms/step | TP=1 eager ms/step | TP=2 ms/step | TP=2 / TP=1 eager "
            "| all-reduce KiB/step | gather KiB/step | broadcast KiB/step | op messages KiB/step |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r.tier} | {r.batch} | {r.tp1_ms:.1f} | {r.tp1_eager_ms:.1f} | {r.tp2_ms:.1f} | "
                     f"{r.ratio:.2f}x | {r.reduced_kib:.0f} | {r.gathered_kib:.0f} | {r.broadcast_kib:.1f} | "
                     f"{r.control_kib:.1f} |")
    return "\n".join(lines)


def plot_scaling(path: Path, rows: list[ScalingRow], machine: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    series = (("TP=1 (default)", "tp1_ms"), ("TP=1 eager", "tp1_eager_ms"), ("TP=2", "tp2_ms"))
    width = 0.8 / len(series)
    for i, (label, attr) in enumerate(series):
        ax.bar([j + i * width for j in range(len(rows))], [getattr(r, attr) for r in rows], width, label=label)
    ax.set_xticks([j + width for j in range(len(rows))], [f"{r.tier}\nbatch {r.batch}" for r in rows], fontsize=8)
    ax.set_ylabel("decode step (ms, median)")
    ax.legend(fontsize=8)
    ax.set_title(f"SmolLM2-135M, tensor parallelism on one machine\n{machine['cpu']}, "
                 f"{machine['torch_threads']} threads: one rank has them all, two ranks share them", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_scaling(out: Path, machine: dict[str, Any], rows: list[ScalingRow]) -> str:
    """scaling.md, scaling.json and scaling.png under `out`; returns the Markdown for stdout."""
    md = write_section(out, "scaling", format_scaling_table(rows),
                       {"machine": machine, "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]})
    plot_scaling(out / "scaling.png", rows, machine)
    return md
