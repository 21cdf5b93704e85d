"""The cost curve: one step's time against its number of rows, per tier and matmul kernel.

Speculation pays when a verify step of k + 1 rows costs little more than a one-row step. For each
configuration below, the bundled model runs a step of n rows of one sequence (a verify step's
shape: n query rows over 64 + n cached tokens), forward plus logits, compiled as the engine runs
it; the figure is the best of `reps` after warm-up. The fast tier is also measured over a long
context (LONG_CONTEXT cached tokens), where attention, which reads every cached key and value for
each row, is part of what a verify row costs. Beside it, the bare loop of the model's own
packed matmuls (the 121 matrices in the order a step calls them, nothing else), with the bytes it
reads and the multiply-adds it does per second, for the profile.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verispec import envs

ROWS = (1, 2, 4, 6, 8, 16)
# (label, LLM options, environment): each a system of its own, loaded one at a time.
CONFIGS: tuple[tuple[str, dict[str, Any], dict[str, str]], ...] = (
    ("fast, verispec packed", {"dtype": "auto"}, {}),
    ("fast, torch int4", {"dtype": "auto"}, {envs.PACKED_KERNEL: "0"}),
    ("exact on codes (verispec decoded)", {"dtype": "float32", "quantization": "gguf"}, {}),
    ("exact fp32 (dense)", {"dtype": "float32"}, {}),
)
CONTEXT = 64  # cached tokens before the step's rows
LONG_CONTEXT = 1024  # the fast tier again, at a context an extractive prompt reaches
VERIFY_ROWS = 6  # k = 5 drafts and the bonus row
VERIFY_TARGET = 1.3  # a 6-row step at most 1.3x a 1-row step in the fast tier


@dataclass(slots=True)
class CurveRow:
    config: str
    rows: int
    step_ms: float
    context: int = CONTEXT  # cached tokens before the step's rows

    def ratio(self, one: "CurveRow") -> float:
        return self.step_ms / one.step_ms


@dataclass(slots=True)
class BareRow:
    """The bare packed loop at one row count on one of the kernel's variants."""

    variant: str  # the packed kernel's variant (packed_variants(); the first is the one steps run)
    rows: int
    ms: float
    gb_s: float  # bytes of weights read per second
    gmac_s: float  # multiply-adds per second


@dataclass(slots=True)
class CostCurve:
    steps: list[CurveRow]
    bare: list[BareRow]


def _step_times(model: Any, rows: tuple[int, ...], reps: int, context: int = CONTEXT) -> dict[int, float]:
    """Best step time per row count. The counts take turns within each repetition, so a slow
    spell of the machine (on a shared VM the same loop moves by tens of percent over a minute)
    hits every count alike instead of one of them."""
    import torch

    from verispec.models.attention import SeqSpan, build_attention_metadata

    blocks = -(-(context + max(rows)) // 16)
    kv = model.new_kv_cache(blocks, 16)
    steps = {}
    for n in rows:
        meta = build_attention_metadata([SeqSpan(0, n, context + n, list(range(blocks)))], 16,
                                        model.embed.device, model.dtype)
        steps[n] = (torch.zeros(n, dtype=torch.long), torch.arange(context, context + n), meta)
    best = dict.fromkeys(rows, float("inf"))
    with torch.inference_mode():  # inference tensors: the compiled graph takes them
        for n, (ids, pos, meta) in steps.items():
            for _ in range(3):
                model.compute_logits(model(ids, pos, meta, kv.layers))
        for _ in range(reps):
            for n, (ids, pos, meta) in steps.items():
                t0 = time.perf_counter()
                model.compute_logits(model(ids, pos, meta, kv.layers))
                best[n] = min(best[n], time.perf_counter() - t0)
    return {n: t * 1e3 for n, t in best.items()}


def _activations(n: int, k: int, dtype: Any) -> Any:
    """Normal activations with one channel in 160 ten times larger: about a fifth of the groups of
    32 are outlier groups, which the kernel gives an int8 residual, as in the model's own verify
    steps (19.8 % of their groups)."""
    import torch

    x = torch.randn(n, k)
    x[:, ::160] *= 10
    return x.to(dtype)


def _bare_packed_loop(model: Any, rows: tuple[int, ...], reps: int) -> list[BareRow]:
    """ms, GB/s and GMAC/s of the model's packed matmuls alone, in step order, on every variant
    this CPU runs: an AVX-512 machine also times the AVX2 code an AVX2-only CPU would run."""
    import torch

    from verispec.models.linear import PackedLinear

    op = torch.ops.verispec_cpu.packed_linear
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    nbytes = sum(m.codes.nbytes + m.scales.nbytes + (0 if m.offsets is None else m.offsets.nbytes) for m in layers)
    macs = sum(m.n * m.codes.shape[1] * 32 for m in layers)
    # The head takes fp32 rows (PackedLinear converts them; here that is done before timing).
    xs = {n: [_activations(n, m.codes.shape[1] * 32, torch.float32 if m.float_output else model.dtype)
              for m in layers] for n in rows}
    cases = [(v, n) for v in torch.ops.verispec_cpu.packed_variants() for n in rows]
    best = dict.fromkeys(cases, float("inf"))
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first round warms up; all cases take turns, as in _step_times
            for v, n in cases:
                t0 = time.perf_counter()
                for m, x in zip(layers, xs[n]):
                    op(x, m.codes, m.scales, m.offsets, m.format, m.n, v)
                best[v, n] = min(best[v, n], time.perf_counter() - t0)
    return [BareRow(v, n, t * 1e3, nbytes / t / 1e9, n * macs / t / 1e9) for (v, n), t in best.items()]


def run_cost_curve(quick: bool, log: Callable[[str], None]) -> CostCurve:
    import gc

    from verispec import LLM
    from verispec.models.linear import PackedLinear

    reps = 5 if quick else 15
    rows: list[CurveRow] = []
    bare: list[BareRow] = []
    configs = CONFIGS[:2] if quick else CONFIGS
    for label, options, env in configs:
        log(f"cost curve: {label} ...")
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            llm = LLM(num_kv_blocks=16, **options)
            model = llm.engine.model
            steps = _step_times(model, ROWS, reps)
            rows += [CurveRow(label, n, steps[n]) for n in ROWS]
            if any(isinstance(m, PackedLinear) for m in model.modules()):
                bare = _bare_packed_loop(model, ROWS, reps)
            if label == CONFIGS[0][0]:
                long = _step_times(model, ROWS, reps, LONG_CONTEXT)
                rows += [CurveRow(long_label(label), n, long[n], context=LONG_CONTEXT) for n in ROWS]
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
            llm = model = None
            gc.collect()
    return CostCurve(rows, bare)


def long_label(label: str) -> str:
    return f"{label}, {LONG_CONTEXT}-token context"


def format_curve(curve: CostCurve) -> str:
    rows = curve.steps
    configs = list(dict.fromkeys(r.config for r in rows))
    lines = ["| configuration | " + " | ".join(f"{n} rows" for n in ROWS) + f" | {VERIFY_ROWS} rows / 1 row |",
             "|---|" + "---|" * (len(ROWS) + 1)]
    for c in configs:
        mine = {r.rows: r for r in rows if r.config == c}
        cells = [f"{mine[n].step_ms:.2f} ms ({mine[n].ratio(mine[1]):.2f}x)" for n in ROWS]
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {mine[VERIFY_ROWS].ratio(mine[1]):.2f}x |")
    lines += _format_bare(curve.bare)
    fast = {r.rows: r for r in rows if r.config == CONFIGS[0][0]}
    if fast:
        ratio = fast[VERIFY_ROWS].ratio(fast[1])
        status = "met" if ratio <= VERIFY_TARGET else "missed"
        lines += ["", f"Target: {VERIFY_ROWS}-row verify step <= {VERIFY_TARGET}x a 1-row step, fast tier: "
                      f"{ratio:.2f}x, {status}"]
    long = {r.rows: r for r in rows if r.config == long_label(CONFIGS[0][0])}
    if long:
        lines += [f"Over a {LONG_CONTEXT}-token context: {long[VERIFY_ROWS].ratio(long[1]):.2f}x"]
    return "\n".join(lines)


def _format_bare(bare: list[BareRow]) -> list[str]:
    """The steps' variant in full (ms, GB/s, GMAC/s), then every variant's ms and 6-row ratio."""
    if not bare:
        return []
    variants = list(dict.fromkeys(r.variant for r in bare))
    lines = ["", f"Bare packed matmul loop (the model's 121 matrices, nothing else), {variants[0]}:", "",
             "| rows | ms | GB/s of weights | GMAC/s |", "|---|---|---|---|"]
    lines += [f"| {r.rows} | {r.ms:.2f} | {r.gb_s:.1f} | {r.gmac_s:.1f} |" for r in bare if r.variant == variants[0]]
    lines += ["", "The same loop on each variant this CPU runs (ms):", "",
              "| variant | " + " | ".join(f"{n} rows" for n in ROWS) + f" | {VERIFY_ROWS} rows / 1 row |",
              "|---|" + "---|" * (len(ROWS) + 1)]
    for v in variants:
        ms = {r.rows: r.ms for r in bare if r.variant == v}
        lines.append(f"| {v} | " + " | ".join(f"{ms[n]:.2f}" for n in ROWS) + f" | {ms[VERIFY_ROWS] / ms[1]:.2f}x |")
    return lines


def plot_curve(path: Path, rows: list[CurveRow]) -> None:  # the steps; the bare loop is a table
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c in dict.fromkeys(r.config for r in rows):
        mine = sorted((r.rows, r.step_ms) for r in rows if r.config == c)
        ax.plot([n for n, _ in mine], [t for _, t in mine], marker="o", label=c)
    ax.set_xlabel(f"rows in the step (one sequence: a verify step's shape; {CONTEXT} cached tokens unless named)")
    ax.set_ylabel("step time, ms (forward + logits)")
    ax.set_xticks(list(ROWS))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("SmolLM2-135M step cost against rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_curve(out: Path, machine: dict[str, Any], curve: CostCurve) -> str:
    md = format_curve(curve)
    (out / "cost_curve.md").write_text(md + "\n")
    (out / "cost_curve.json").write_text(json.dumps({"machine": machine, **asdict(curve)}, indent=1))
    plot_curve(out / "cost_curve.png", curve.steps)
    return md
