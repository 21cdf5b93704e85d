"""Speculative decoding sweep: Spec-Bench-style categories, each drafter against no drafter.

Batch 1, greedy, on the bundled model, all in one run: per category and drafter, the mean
acceptance length, tok/s, the speed-up over verispec without speculation, and whether the output
is identical to the non-speculative one (it must be: verification is lossless).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.tiers import EXACT

# Our own short texts in the categories Spec-Bench uses.
_DOC = (
    "The Harbor Bridge will be closed to cars from 10 pm Friday to 6 am Monday while crews replace "
    "the expansion joints. Buses will detour over the Mill Street Bridge and add about ten minutes "
    "to each trip. Cyclists and pedestrians can still cross on the north walkway, which stays open "
    "the whole weekend. The city asks drivers to use the ring road and to avoid the old town."
)
_CONTEXT = (
    "Document 1: The Orion greenhouse grows tomatoes, basil and peppers under LED lights, using 40 "
    "percent less water than open fields. Document 2: Its harvest is sold at the Saturday market on "
    "Quay Square from 8 am to 1 pm. Document 3: Visitors can tour the greenhouse on the first "
    "Sunday of each month; tickets cost 5 euros and children enter free."
)
CATEGORIES: dict[str, list[list[dict[str, str]]]] = {
    "multi_turn": [
        [{"role": "user", "content": "I want to start running. How often should I run in the first month?"},
         {"role": "assistant", "content": "Start with three short runs a week, with a rest day between them."},
         {"role": "user", "content": "And how long should each of those runs be?"}],
        [{"role": "user", "content": "Give me a name for a bakery."},
         {"role": "assistant", "content": "How about 'The Rising Loaf'?"},
         {"role": "user", "content": "Nice. Now write a one-line slogan for The Rising Loaf."}],
    ],
    "translation": [
        [{"role": "user", "content": "Translate to French: The museum opens at nine and closes at six, "
                                     "except on Mondays when it is closed all day."}],
        [{"role": "user", "content": "Translate to German: Please leave your shoes at the door and "
                                     "take a seat in the living room."}],
    ],
    "summarization": [
        [{"role": "user", "content": f"Summarize this notice in a few sentences, reusing its wording:\n\n{_DOC}"}],
        [{"role": "user", "content": f"Rewrite this notice as a short bulletin for drivers, keeping the "
                                     f"facts and wording:\n\n{_DOC}"}],
    ],
    "qa": [
        [{"role": "user", "content": "Why is the sky blue? Answer in a short paragraph."}],
        [{"role": "user", "content": "What is the difference between a virus and a bacterium?"}],
    ],
    "math": [
        [{"role": "user", "content": "A train travels 180 km in 2 hours. What is its average speed? Show the steps."}],
        [{"role": "user", "content": "Solve for x: 3x + 7 = 25. Explain each step."}],
    ],
    "rag": [
        [{"role": "user", "content": f"{_CONTEXT}\n\nUsing the documents, when and where can I buy the "
                                     f"greenhouse's tomatoes, and how can I visit it? Quote the documents."}],
        [{"role": "user", "content": f"{_CONTEXT}\n\nAnswer from the documents only: how much water does "
                                     f"the greenhouse save, and what does a tour cost?"}],
    ],
}

# Drafter configurations swept (None = no speculation, the reference).
DRAFTERS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},  # lookup 2..4 (the defaults)
    "ngram k=5": {"method": "ngram", "num_speculative_tokens": 5},
    "ngram k=3 lookup 1..3": {"method": "ngram", "num_speculative_tokens": 3,
                              "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "layer_skip L=15 k=2": {"method": "layer_skip", "num_layers": 15, "num_speculative_tokens": 2},
}
# --quick sweeps the drafter the bench's extractive scenario uses (ngram k=5), so both engines
# can be the ones the bench has already loaded.
QUICK_DRAFTERS = ("none", "ngram k=5")


@dataclass(slots=True)
class SpecRow:
    category: str
    drafter: str
    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    accepted: int = 0
    identical: bool = True
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


def run_sweep(max_tokens: int, quick: bool, log: Callable[[str], None],
              loaded: dict[str, Any] | None = None) -> list[SpecRow]:
    """Every drafter runs each prompt back to back with the reference, so a machine whose speed
    drifts during the sweep (shared VMs do) skews every system alike and the ratios hold.

    `loaded` maps drafter names to engines already built with that configuration; they are used
    instead of new ones (each load costs seconds, which --quick cannot spare).
    """
    from verispec import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = {c: convs[:1] if quick else convs for c, convs in CATEGORIES.items()}
    names = list(QUICK_DRAFTERS if quick else DRAFTERS)
    # A small pool each: batch 1 needs a few hundred tokens of cache, not the default 1 GiB. The
    # sweep measures the exact tier, named explicitly so LLM()'s default dtype cannot change that.
    loaded = loaded or {}
    engines = {name: loaded.get(name) or LLM(dtype=EXACT.dtype, speculative_config=DRAFTERS[name], num_kv_blocks=128)
               for name in names}
    for llm in engines.values():
        llm.chat(prompts["qa"][0], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    rows: list[SpecRow] = []
    for category, convs in prompts.items():
        by_name = {name: SpecRow(category, name) for name in names}
        for conv in convs:
            for name in names:
                llm, row = engines[name], by_name[name]
                before = llm.stats()
                llm.reset_prefix_cache()  # each drafter computes the whole prompt, as the first did
                start = time.perf_counter()
                out = llm.chat(conv, params, use_tqdm=False)[0].outputs[0]
                row.seconds += time.perf_counter() - start
                after = llm.stats()
                row.tokens += len(out.token_ids)
                row.drafts += after["num_drafts"] - before["num_drafts"]
                row.accepted += after["num_accepted_tokens"] - before["num_accepted_tokens"]
                row.outputs.append(list(out.token_ids))
        for name in names:
            row = by_name[name]
            row.identical = row.outputs == by_name["none"].outputs
            rows.append(row)
            log(f"  spec {name:>22} {category:>13}: {row.tok_s:6.1f} tok/s, "
                f"acceptance length {row.mean_acceptance_length:.2f}, identical {row.identical}")
    engines.clear()
    return rows


def format_spec_table(rows: list[SpecRow]) -> str:
    base = {r.category: r.tok_s for r in rows if r.drafter == "none"}
    lines = ["| category | drafter | tok/s | speed-up vs none | mean acceptance length | identical to none |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        speedup = r.tok_s / base[r.category] if base.get(r.category) else 0.0
        lines.append(f"| {r.category} | {r.drafter} | {r.tok_s:.1f} | {speedup:.2f}x | "
                     f"{r.mean_acceptance_length:.2f} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)


def spec_json(rows: list[SpecRow]) -> list[dict[str, Any]]:
    return [{"category": r.category, "drafter": r.drafter, "tokens": r.tokens, "seconds": r.seconds,
             "tok_s": r.tok_s, "mean_acceptance_length": r.mean_acceptance_length,
             "identical_to_none": r.identical} for r in rows]


def plot_spec(path: Path, rows: list[SpecRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(r.category for r in rows))
    drafters = list(dict.fromkeys(r.drafter for r in rows))
    width = 0.8 / len(drafters)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, d in enumerate(drafters):
        vals = [next((r.tok_s for r in rows if r.category == c and r.drafter == d), 0.0) for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], vals, width, label=d)
    ax.set_xticks([x + width * (len(drafters) - 1) / 2 for x in range(len(categories))], categories)
    ax.set_ylabel("tok/s (batch 1, greedy)")
    ax.set_title("verispec speculative decoding by category (SmolLM2-135M fp32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_spec(out: Path, machine: dict[str, Any], rows: list[SpecRow]) -> str:
    """spec.md, spec.json and spec.png under `out`; returns the table for stdout."""
    table = format_spec_table(rows)
    (out / "spec.md").write_text(table + "\n")
    (out / "spec.json").write_text(json.dumps({"machine": machine, "rows": spec_json(rows)}, indent=2))
    plot_spec(out / "spec.png", rows)
    return table
