"""In-place weight updates (docs/rl.md), in one run (verispec only, in process): how long
`LLM.update_weights` takes for every tensor of SmolLM2, moved by 1 % of its spread, in the exact
and the fast tier. Beside it is what an RL loop would pay without the update: a fresh `LLM` from the same
file (checkpoint read, kernels and compile caches warm, so the cheapest possible reload)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import write_section


TIERS = {"exact": {"dtype": "float32"}, "fast": {}}
TARGET_S = {"exact": 1.0, "fast": 3.0}  # the bounds for SmolLM2


@dataclass(slots=True)
class WeightsRow:
    tier: str
    num_tensors: int
    update_s: float  # median of the timed updates
    reload_s: float  # a fresh LLM on the same file
    target_s: float

    @property
    def met(self) -> bool:
        return self.update_s <= self.target_s


def hf_state(path: str) -> dict[str, Any]:
    """SmolLM2's tensors under HF's names, dequantized, each moved by 1 % of its spread."""
    import torch

    from verispec.models.loader import internal_name, load_checkpoint
    from verispec.models.weights import expected_shapes

    cfg, weights = load_checkpoint(path, torch.float32, None)
    names = {}
    for i in range(cfg.num_layers):
        for hf in ("input_layernorm", "post_attention_layernorm"):
            names[f"model.layers.{i}.{hf}.weight"] = None
        for hf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj"):
            names[f"model.layers.{i}.{hf}.weight"] = None
    names |= {"model.embed_tokens.weight": None, "model.norm.weight": None}
    g = torch.Generator().manual_seed(0)
    out = {}
    for hf in names:
        t = weights[internal_name(hf)]
        out[hf] = t + 0.01 * t.std() * torch.randn(t.shape, generator=g)
    assert {internal_name(n) for n in out} == set(expected_shapes(cfg))
    return out


def run_weights(quick: bool, log: Callable[[str], None]) -> list[WeightsRow]:
    from verispec import LLM
    from verispec.models.default import default_model_path

    path = default_model_path()
    state = hf_state(path)
    rows = []
    for tier, options in TIERS.items():
        start = time.perf_counter()
        llm = LLM(path, **options)
        reload_s = time.perf_counter() - start
        times = [llm.update_weights(state).seconds for _ in range(2 if quick else 3)]
        rows.append(WeightsRow(tier, len(state), statistics.median(times), reload_s, TARGET_S[tier]))
        log(f"  {tier}: update {rows[-1].update_s:.2f} s, a fresh LLM {reload_s:.1f} s")
        llm.shutdown()
        del llm
    return rows


def format_weights(rows: list[WeightsRow]) -> str:
    lines = ["| tier | tensors | update (median) | a fresh LLM instead | target | met |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.tier} | {r.num_tensors} | {r.update_s:.2f} s | {r.reload_s:.1f} s | "
                     f"< {r.target_s:.0f} s | {'yes' if r.met else 'NO'} |")
    return "\n".join(lines)


def write_weights(out: Path, machine: dict[str, Any], rows: list[WeightsRow]) -> str:
    return write_section(out, "weights", format_weights(rows),
                         {"machine": machine, "rows": [{**asdict(r), "met": r.met} for r in rows]})
