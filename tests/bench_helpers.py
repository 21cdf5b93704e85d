"""Small builders shared by the benchmark tests (benchmarks/ is not part of the package)."""

from __future__ import annotations

import argparse

from benchmarks.__main__ import build_parser
from benchmarks.fidelity import Fidelity
from benchmarks.system import PLAIN
from benchmarks.report import THROUGHPUT, Result
from benchmarks.tiers import FAST, FidelityRow


def bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def bench_row(system: str, scenario: str, tok_s: list[float], variant: str = PLAIN, metric: str = THROUGHPUT,
              label: str | None = None, load: float = 0.0) -> Result:
    """A measured row: `tok_s` per run (for TTFT rows, 1 / seconds)."""
    r = Result(system, label or f"{system}{'' if variant == PLAIN else ' + spec'}", scenario, 1, 128,
               variant=variant, metric=metric, prompt_tokens=2000)
    r.tokens = [128 if metric == THROUGHPUT else 1] * len(tok_s)
    r.seconds = [t / v for t, v in zip(r.tokens, tok_s)]
    r.others_load = [load] * len(tok_s)
    return r


def fidelity_row(kl: float, top1: float, label: str = FAST.label) -> FidelityRow:
    return FidelityRow(FAST.key, label, 16, 128, {"dtype": "bfloat16", "quantization": "gguf"},
                       Fidelity(2040, kl, top1, 0.125), 300.0)


def saved_figures(monkeypatch) -> list:
    """Figures as they are saved (the plot functions close them right after)."""
    from matplotlib.figure import Figure

    saved, original = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (saved.append(fig), original(fig, *a, **kw))[1])
    return saved
