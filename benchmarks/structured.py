"""Structured output's cost, in one run (verispec only, the default fast tier, in process).

- `batch16_json`: the bench's 16 chat prompts at once, each under a JSON schema, against the same
  prompts unconstrained; tok/s, alternating rounds, medians; and the host's grammar work per step
  (llguidance's masks, packing them into a tensor, applying them to the logits).
- `extractive_json`: one long notice and a schema whose fields are copied verbatim from it, with
  and without ngram drafts; the speculative speed-up under the grammar against the speed-up on the
  same prompt unconstrained (an extractive summary).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.prompts import _render, chat_prompts, extractive_prompt
from benchmarks.texts import REPORT

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
# A schema for any chat answer: the model's answer in a string, plus a little structure.
ANSWER = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 400}, "confidence": {"enum": ["low", "medium", "high"]},
    "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
    "required": ["answer", "confidence", "keywords"], "additionalProperties": False}
# Fields the notice states word for word: prompt lookup should find them.
NOTICE = {"type": "object", "properties": {
    "title": {"type": "string"}, "closed_from": {"type": "string"}, "closed_until": {"type": "string"},
    "temporary_branch": {"type": "string"}, "opening_hours": {"type": "string"}, "grant": {"type": "string"},
    "changes": {"type": "array", "items": {"type": "string"}, "maxItems": 6}},
    "required": ["title", "closed_from", "closed_until", "temporary_branch", "opening_hours", "grant", "changes"],
    "additionalProperties": False}
EXTRACT_INSTRUCTION = ("Fill in the JSON record of the notice below. Copy every value exactly as the notice writes "
                       "it, word for word.")


@dataclass(slots=True)
class StructuredRow:
    workload: str
    metric: str
    reference: float  # unconstrained
    constrained: float
    target: float
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.constrained / self.reference if self.reference else 0.0

    @property
    def met(self) -> bool:
        return self.ratio >= self.target


@dataclass(slots=True)
class StructuredResults:
    rows: list[StructuredRow] = field(default_factory=list)
    mask_ms_per_step: dict[str, float] = field(default_factory=dict)


class _GrammarTimer:
    """Wall time in the grammar's three host stages, by wrapping them for the run."""

    def __init__(self) -> None:
        import verispec.sample.grammar as grammar
        import verispec.sample.metadata as metadata
        import verispec.sample.processors as processors

        self.seconds = {"masks": 0.0, "pack": 0.0, "apply": 0.0}
        self._patches = [(grammar.RequestGrammar, "row_masks", "masks"), (metadata, "bitmask_tensor", "pack"),
                         (processors, "apply_bitmask", "apply")]
        self._saved = []
        for owner, name, key in self._patches:
            orig = getattr(owner, name)
            self._saved.append((owner, name, orig))
            setattr(owner, name, self._timed(orig, key))

    def _timed(self, fn: Callable, key: str) -> Callable:
        def wrapper(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[key] += time.perf_counter() - start
        return wrapper

    def close(self) -> None:
        for owner, name, orig in self._saved:
            setattr(owner, name, orig)


def _tok_s(llm: Any, prompts: list[dict], params: Any) -> tuple[float, list[Any]]:
    llm.reset_prefix_cache()  # every run computes its prompts in full
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start), outs


def run_structured(tokenizer: Any, quick: bool, max_tokens: int, runs: int,
                   log: Callable[[str], None]) -> StructuredResults:
    from verispec import LLM, SamplingParams

    res = StructuredResults()
    rounds = 1 if quick else max(runs, 1) * 2 - 1
    llm = LLM()
    prompts = [{"prompt_token_ids": p.ids} for p in chat_prompts(tokenizer, 16)]
    # The unconstrained run makes as many tokens as the constrained one did, so both time the same work.
    json_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs={"json": ANSWER})
    # Warm-up, grammar included: llguidance's tokenizer (about 1 s, once) and the schema's compile.
    _tok_s(llm, prompts, SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"json": ANSWER}))
    rates: dict[str, list[float]] = {"plain": [], "json": []}
    timer_steps, timer = 0, None
    for r in range(rounds):
        steps = llm.engine.num_steps
        timer = _GrammarTimer()
        try:
            rate, outs = _tok_s(llm, prompts, json_params)
        finally:
            timer.close()
        timer_steps = llm.engine.num_steps - steps
        rates["json"].append(rate)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        plain = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in lengths]
        rates["plain"].append(_tok_s(llm, prompts, plain)[0])
        log(f"structured batch16 round {r + 1}: plain {rates['plain'][-1]:.1f} tok/s, json {rate:.1f} tok/s")
    res.mask_ms_per_step = {k: v / timer_steps * 1e3 for k, v in timer.seconds.items()} if timer_steps else {}
    res.rows.append(StructuredRow(
        "batch16_json", "tok/s", statistics.median(rates["plain"]), statistics.median(rates["json"]), 0.85,
        "16 chat prompts; grammar host work per step " +
        ", ".join(f"{k} {v:.2f} ms" for k, v in res.mask_ms_per_step.items())))

    spec_llm = LLM(speculative_config=SPEC)
    extract = _render(tokenizer, "extract", EXTRACT_INSTRUCTION + "\n\n" + "\n\n".join(REPORT))
    summary = extractive_prompt(tokenizer)
    cases = {"free": ([{"prompt_token_ids": summary.ids}], SamplingParams(temperature=0.0, max_tokens=max_tokens)),
             "json": ([{"prompt_token_ids": extract.ids}],
                      SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs={"json": NOTICE}))}
    speedups: dict[str, list[float]] = {"free": [], "json": []}
    for engine in (llm, spec_llm):
        _tok_s(engine, *cases["json"])  # warm-up, grammar compiled
    for r in range(rounds):
        for name, (p, params) in cases.items():
            base = _tok_s(llm, p, params)[0]
            fast = _tok_s(spec_llm, p, params)[0]
            speedups[name].append(fast / base)
        log(f"structured extractive round {r + 1}: ngram speed-up free {speedups['free'][-1]:.2f}x, "
            f"json {speedups['json'][-1]:.2f}x")
    res.rows.append(StructuredRow(
        "extractive_json", "ngram speed-up", statistics.median(speedups["free"]), statistics.median(speedups["json"]),
        0.90, "one 630-token notice; free: an extractive summary, json: a record copied from it"))
    return res


def format_structured_table(res: StructuredResults) -> str:
    lines = ["| workload | metric | unconstrained | with a grammar | ratio | target | status | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res.rows:
        lines.append(f"| {r.workload} | {r.metric} | {r.reference:.3g} | {r.constrained:.3g} | {r.ratio:.2f}x | "
                     f">= {r.target:g}x | {'met' if r.met else 'missed'} | {r.note} |")
    return "\n".join(lines)


def write_structured(out: Path, machine: dict[str, Any], res: StructuredResults) -> str:
    """structured.md and structured.json under `out`; returns the Markdown for stdout."""
    md = format_structured_table(res)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.md").write_text(md + "\n")
    rows = [{**asdict(r), "ratio": r.ratio, "met": r.met} for r in res.rows]
    (out / "structured.json").write_text(json.dumps(
        {"machine": machine, "rows": rows, "mask_ms_per_step": res.mask_ms_per_step}, indent=2))
    return md
