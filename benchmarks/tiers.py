"""verispec's two precision tiers in the peer benchmark, and the fast tier's fidelity against HF fp32.

- exact tier: `LLM(dtype="float32")`, dense fp32 weights, logprobs within ~1e-5 of HF fp32; the
  reference every other row's greedy output is compared with;
- fast tier: `LLM(dtype="auto")`, which on the GGUF file keeps the Q4_1/Q8_0 blocks packed
  (bfloat16 activations; on a CPU, verispec's packed kernel, activations quantized per block of 32).

Both pass `dtype` explicitly, so a change of `LLM()`'s default never silently changes a row.
The fast tier's outputs are not expected to equal the exact tier's; how far its distributions are
from HF fp32 is measured by `benchmarks.fidelity` (mean KL, top-1 agreement) while HF is loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.fidelity import KL_BAR, TOP1_BAR, Fidelity, measure
from benchmarks.prompts import Prompt
from benchmarks.report import _render


@dataclass(frozen=True, slots=True)
class Tier:
    key: str  # the Result.system of its rows
    label: str
    dtype: str  # LLM(dtype=...)
    # The speculative row verifies with adaptive verification: once the packed kernel is
    # compute-bound (a few rows on a CPU) a verify row is not free, so the budget chooser, with
    # the tier's own profiled cost curve, decides how many drafts pay.
    adaptive: bool = False


EXACT = Tier("verispec", "verispec", "float32")
FAST = Tier("verispec_fast", "verispec fast (gguf packed)", "auto", adaptive=True)
TIERS: dict[str, Tier] = {t.key: t for t in (EXACT, FAST)}

# (prompts, new tokens) of the fidelity check: the bar's own size in a full run; a smoke-test
# size under --quick, where the check costs ~0.15 s per token on a 2-core machine.
FIDELITY_FULL = (16, 128)
FIDELITY_QUICK = (2, 16)
# The fidelity engine only lends its model to the check, which allocates its own KV cache.
_FIDELITY_KV_BLOCKS = 4


def fidelity_size(quick: bool) -> tuple[int, int]:
    return FIDELITY_QUICK if quick else FIDELITY_FULL


def resolved_precision(llm: Any) -> dict[str, str | None]:
    """What `dtype="auto"` (or an explicit dtype) resolved to on the model file."""
    cfg = llm.engine.config
    return {"dtype": str(cfg.dtype).removeprefix("torch."), "quantization": cfg.quantization}


@dataclass(slots=True)
class FidelityRow:
    tier: str  # Tier.key
    label: str
    prompts: int
    max_tokens: int  # HF's greedy continuation per prompt (shorter where HF emits EOS)
    precision: dict[str, str | None]
    fidelity: Fidelity
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "prompts": self.prompts, "max_tokens": self.max_tokens, **self.precision,
                **self.fidelity.as_dict(), "kl_bar": KL_BAR, "top1_bar": TOP1_BAR, "seconds": self.seconds}


def measure_fidelity(hf_model: Any, tier: Tier, prompts: list[Prompt], max_tokens: int,
                     log: Callable[[str], None]) -> FidelityRow:
    """Load the tier's engine, score it against `hf_model` on `prompts`, drop the engine again.

    A fresh engine (~10 s to load here) keeps the bench one system at a time: the tier's own
    system was closed before HF loaded, and only its model is needed, not its KV pool.
    """
    from verispec import LLM

    start = time.perf_counter()
    llm = LLM(dtype=tier.dtype, num_kv_blocks=_FIDELITY_KV_BLOCKS)
    try:
        precision = resolved_precision(llm)
        fid = measure(hf_model, llm.engine.model, [p.ids for p in prompts], max_tokens)
    finally:
        del llm
    row = FidelityRow(tier.key, tier.label, len(prompts), max_tokens, precision, fid, time.perf_counter() - start)
    log(f"  {tier.label} fidelity vs HF fp32 over {fid.tokens} tokens: mean KL {fid.mean_kl:.2e}, "
        f"top-1 {fid.top1:.1%}, max |logprob diff| {fid.max_logprob_diff:.2e} ({row.seconds:.0f}s)")
    return row


def format_fidelity_table(rows: list[FidelityRow], markdown: bool = False) -> str:
    """One row per measured tier; empty string if none was measured (no HF, or no scenario ran)."""
    head = ["tier", "weights", "tokens", "mean KL vs HF fp32", "top-1 agreement", "max abs logprob diff",
            f"bar met (KL <= {KL_BAR:g}, top-1 >= {TOP1_BAR:.0%})"]
    body = []
    for r in rows:
        f = r.fidelity
        weights = r.precision["dtype"] or "?"
        if r.precision["quantization"]:
            weights += f", {r.precision['quantization']}"
        body.append([r.label, weights, f"{f.tokens} ({r.prompts} x {r.max_tokens})", f"{f.mean_kl:.2e}",
                     f"{f.top1:.1%}", f"{f.max_logprob_diff:.2e}", "yes" if f.meets_bar else "no"])
    return _render(head, body, markdown) if body else ""
