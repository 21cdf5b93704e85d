"""`python -m benchmarks`: verispec against HF transformers and llama.cpp on the bundled model, in one run.

All systems run the same prompts (same token ids) on SmolLM2-135M-Instruct, greedy, with exactly
`max_tokens` new tokens per prompt, one system loaded at a time (so they never compete for the
cores). Each figure is the median of `runs` timed runs after one untimed warm-up. The tables say
whether each output equals verispec's plain greedy output, the mean acceptance length of the
speculative variants, and how far verispec's logprobs are from HF's for the same tokens.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from benchmarks.adaptive import AdaptiveRow, run_adaptive, write_adaptive
from benchmarks.options import BenchConfig, resolve
from benchmarks.peers import load_system
from benchmarks.plot import plot
from benchmarks.prompts import Prompt, chat_prompts
from benchmarks.report import (
    BUSY_CORES,
    busy_seconds,
    self_seconds,
    Result,
    format_ratios,
    format_table,
    format_ttft_table,
    machine_info,
    write_json,
)
from benchmarks.extras import EXTRAS
from benchmarks.scenarios import (
    ADAPTIVE_SCENARIO,
    SCENARIOS,
    SPEC_SCENARIO,
    Scenario,
    build_prompts,
    compare,
    headlines,
    max_abs_diff,
)
from benchmarks.spec import SpecRow, run_sweep, write_spec
from benchmarks.system import PEERS, PLAIN, Generation, PeerUnavailable, System
from benchmarks.targets import Outcome, evaluate, format_targets
from benchmarks.tiers import (
    FAST,
    TIERS,
    FidelityRow,
    fidelity_size,
    format_fidelity_table,
    measure_fidelity,
)

# The warm-up only has to touch every code path (prefill, decode, allocator, thread pools), not
# to be long: a few tokens of the real scenario do that and keep --quick quick.
WARMUP_TOKENS = 8
# --quick also warms up on at most this many prompt tokens: a full-length warm-up of the 2k-token
# TTFT prompt or the extractive one costs more than the timed run in a one-run smoke test.
QUICK_WARMUP_PROMPT_TOKENS = 256


@dataclass(slots=True)
class LogprobCheck:
    """An untimed verispec run with logprobs=1, waiting for HF's reference logprobs."""

    result: Result
    prompts: list[Prompt]
    gen: Generation


@dataclass(slots=True)
class RunState:
    results: list[Result] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    refs: dict[str, Generation] = field(default_factory=dict)  # verispec plain output per scenario
    checks: list[LogprobCheck] = field(default_factory=list)
    spec_rows: list[SpecRow] = field(default_factory=list)
    adaptive_rows: list[AdaptiveRow] = field(default_factory=list)
    precision: dict[str, dict[str, str | None]] = field(default_factory=dict)  # per verispec tier
    fidelity_prompts: list[Prompt] = field(default_factory=list)  # measured while HF is loaded
    fidelity: list[FidelityRow] = field(default_factory=list)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _add(total: int | None, part: int | None) -> int | None:
    return part if total is None else total if part is None else total + part


def _measure(system: System, sc: Scenario, variant: str, prompts: list[Prompt], cfg: BenchConfig,
             state: RunState) -> Result:
    max_tokens = sc.fixed_tokens or cfg.max_tokens
    label = system.variant_label(variant)
    res = Result(system.key, label, sc.name, len(prompts), max_tokens, variant=variant, metric=sc.metric,
                 prompt_tokens=max(len(p.ids) for p in prompts))
    extra = {"logprobs": sc.logprobs} if sc.logprobs else {}
    warm = [Prompt(p.question, p.text, p.ids[:QUICK_WARMUP_PROMPT_TOKENS]) for p in prompts] if cfg.quick else prompts
    system.generate(warm, min(WARMUP_TOKENS, max_tokens), variant, **extra)  # warm-up, not timed
    gen: Generation | None = None
    for i in range(cfg.runs):
        busy, mine, start = busy_seconds(), self_seconds(), time.perf_counter()
        gen = system.generate(prompts, max_tokens, variant, **extra)
        wall = time.perf_counter() - start
        after = busy_seconds()
        res.seconds.append(wall)
        res.tokens.append(sum(gen.lengths))
        res.spec_steps, res.spec_tokens = _add(res.spec_steps, gen.spec_steps), _add(res.spec_tokens, gen.spec_tokens)
        if busy is not None and after is not None:
            # Everyone's CPU time minus ours = what other processes took from the benchmark.
            res.others_load.append(max(0.0, (after - busy) - (self_seconds() - mine)) / wall)
        log(f"  {label} {sc.name} run {i + 1}/{cfg.runs}: {res.tokens[-1]} tokens in {wall:.2f}s = "
            f"{res.tok_s[-1]:.1f} tok/s" + (f", other processes used {res.others_load[-1]:.2f} cores"
                                            if res.others_load else ""))
    assert gen is not None
    res.short = sum(1 for n in gen.lengths if n < max_tokens)
    is_ref = system.key == "verispec" and variant == PLAIN
    if is_ref:
        state.refs[sc.name] = gen
    res.equal = compare(system.compare, gen, state.refs.get(sc.name), is_ref)
    log(f"  {label} {sc.name} first output: {gen.texts[0][:70]!r}"
        + (f", acceptance length {res.acceptance:.2f}" if res.acceptance is not None else ""))
    return res


def _run_system(system: System, cfg: BenchConfig, prompts: dict[str, list[Prompt]], state: RunState) -> None:
    if system.key in TIERS:
        state.precision[system.key] = system.precision()  # type: ignore[attr-defined]
    for name in cfg.scenarios:
        sc = SCENARIOS.get(name)
        if sc is None or (sc.verispec_only and system.key != "verispec"):
            continue
        for variant in sc.variants:
            res = _measure(system, sc, variant, prompts[name], cfg, state)
            state.results.append(res)
            if sc.check_logprobs and system.key in TIERS:
                # Outside the timed runs: logprobs=1 returns the sampled token's logprob.
                gen = system.generate(prompts[name], cfg.max_tokens, variant, logprobs=1)
                state.checks.append(LogprobCheck(res, prompts[name], gen))
    if system.key == "verispec" and SPEC_SCENARIO in cfg.scenarios:
        log("speculative decoding sweep (verispec, batch 1) ...")
        state.spec_rows = run_sweep(cfg.max_tokens, cfg.quick, log, system.engines())  # type: ignore[attr-defined]
    if system.key == FAST.key and ADAPTIVE_SCENARIO in cfg.scenarios:
        log("adaptive verification sweep (verispec fast tier, by batch size) ...")
        # The bench's plain engine is the sweep's reference; no other bench engine matches a config.
        state.adaptive_rows = run_adaptive(cfg.max_tokens, cfg.runs, cfg.quick, log,
                                           {"none": system.llm},  # type: ignore[attr-defined]
                                           queue=cfg.adaptive_queue)
    if system.key == "hf":
        for check in state.checks:
            # HF's log_softmax of its own logits for verispec's exact token sequence.
            theirs = [system.token_logprobs(p.ids, ids)  # type: ignore[attr-defined]
                      for p, ids in zip(check.prompts, check.gen.token_ids or [])]
            check.result.logprob_diff = max_abs_diff(check.gen.logprobs or [], theirs)
            log(f"  {check.result.label} {check.result.scenario}: max |logprob - HF| = {check.result.logprob_diff:.2e}")
        if state.fidelity_prompts:
            hf_model = system.model  # type: ignore[attr-defined]
            try:
                state.fidelity.append(measure_fidelity(hf_model, FAST, state.fidelity_prompts,
                                                       fidelity_size(cfg.quick)[1], log))
            except Exception as exc:  # noqa: BLE001 - the timed rows stay valid without it
                state.errors["fidelity"] = f"fidelity check failed: {exc!r}"
                log(f"fidelity check failed:\n{traceback.format_exc()}")


def _measure_all(cfg: BenchConfig, model_path: str, threads: int, tokenizer: Any,
                 prompts: dict[str, list[Prompt]], state: RunState) -> bool:
    """Every system in turn; False if verispec's exact tier (the reference) could not load."""
    # Both verispec tiers first: the exact tier is every scenario's reference, and HF (if asked for)
    # then checks both tiers' logprobs in its own phase.
    for key in [*TIERS, *cfg.peers]:
        label = PEERS[key].label if key in PEERS else TIERS[key].label
        log(f"loading {label} ...")
        start = time.perf_counter()
        try:
            system = load_system(key, model_path, threads, tokenizer, log)
        except PeerUnavailable as exc:
            state.skipped[key] = str(exc)
            log(f"skipping {label}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - a broken peer must not hide the others' results
            state.errors[key] = f"load failed: {exc!r}"
            log(f"{label} failed to load:\n{traceback.format_exc()}")
            if key == "verispec":
                return False  # nothing to compare against
            continue
        log(f"{label} loaded in {time.perf_counter() - start:.1f}s")
        try:
            _run_system(system, cfg, prompts, state)
        except Exception as exc:  # noqa: BLE001 - same: record it, go on with the next system
            state.errors[key] = f"run failed: {exc!r}"
            log(f"{label} failed:\n{traceback.format_exc()}")
        finally:
            system.close()
            del system
            gc.collect()  # free one model's memory before the next system loads
        log(f"{label} done after {time.perf_counter() - start:.0f}s")
    return True


def _logprobs_share(results: list[Result]) -> float | None:
    by = {r.scenario: r.median for r in results if r.system == "verispec" and r.variant == PLAIN and r.tokens}
    if "batch16" in by and "batch16_logprobs" in by:
        return by["batch16_logprobs"] / by["batch16"]
    return None



def _optional(cfg: BenchConfig, state: RunState, scenario: str, what: str, fn: Callable[[], Any]) -> Any:
    """A verispec-only scenario's results, or None when it was not asked for or failed (the
    failure is recorded; the other tables stay valid without it)."""
    if scenario not in cfg.scenarios:
        return None
    log(f"{what} ...")
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        state.errors[scenario] = f"{scenario} benchmark failed: {exc!r}"
        log(f"{scenario} benchmark failed:\n{traceback.format_exc()}")
        return None


def _config(cfg: BenchConfig, model_path: str, prompts: dict[str, list[Prompt]], state: RunState) -> dict[str, Any]:
    """bench.json's record of what ran."""
    return {
        "model": model_path,
        "quick": cfg.quick,
        "max_tokens": cfg.max_tokens,
        "runs": cfg.runs,
        "warmup_tokens": min(WARMUP_TOKENS, cfg.max_tokens),
        "scenarios": {s: _describe(s) for s in cfg.scenarios},
        "prompt_tokens": {s: [len(p.ids) for p in ps] for s, ps in prompts.items()},
        "peers": cfg.peers,
        "sampling": "greedy; EOS forbidden so each prompt yields exactly max_tokens tokens",
        "logprobs20_share_of_batch16": _logprobs_share(state.results),
        "precision": state.precision,  # what each verispec tier's dtype resolved to
    }


def _describe(scenario: str) -> str:
    if scenario in SCENARIOS:
        return SCENARIOS[scenario].description()
    summaries = {x.scenario: x.summary for x in EXTRAS}
    return summaries.get(scenario, "adaptive verification sweep" if scenario == ADAPTIVE_SCENARIO else "speculative sweep")


def _sweeps(cfg: BenchConfig, state: RunState, measured: bool) -> tuple[list[SpecRow], list[AdaptiveRow]]:
    """The speculative and adaptive sweeps: from the systems' phase, or run here on their own
    engines where no system ran (the sweeps alone: no bench engines to reuse)."""
    spec_rows, adaptive_rows = state.spec_rows, state.adaptive_rows
    if SPEC_SCENARIO in cfg.scenarios and not measured:
        log("speculative decoding sweep (verispec, batch 1) ...")
        spec_rows = run_sweep(cfg.max_tokens, cfg.quick, log)
    if ADAPTIVE_SCENARIO in cfg.scenarios and not measured:
        log("adaptive verification sweep (verispec, by batch size) ...")
        adaptive_rows = run_adaptive(cfg.max_tokens, cfg.runs, cfg.quick, log, queue=cfg.adaptive_queue)
    return spec_rows, adaptive_rows


def _print_tables(results: list[Result], heads: dict[str, str], outcomes: list[Outcome], state: RunState) -> None:
    """The systems' tables, the ratios and targets, the fidelity bar, and what was skipped or failed."""
    print(format_table(results, headline=heads))
    if ttft_table := format_ttft_table(results):
        print()
        print(ttft_table)
    if any(r.busy for r in results):
        print(f"(busy): other processes used over {BUSY_CORES} cores during a run; that figure is suspect")
    if summary := format_ratios(results, heads):
        print()
        print(summary)
    if (share := _logprobs_share(results)) is not None:
        print(f"verispec throughput with logprobs=20: {share:.1%} of the same batch without logprobs")
    print()
    print(format_targets(outcomes))
    if fidelity_table := format_fidelity_table(state.fidelity):
        print()
        print(fidelity_table)
    for key, why in {**state.skipped, **state.errors}.items():
        print(f"{key}: {why}")


def _write_sections(cfg: BenchConfig, machine: dict[str, Any], spec_rows: list[SpecRow],
                    adaptive_rows: list[AdaptiveRow], extras: dict[str, Any], state: RunState) -> None:
    """Each verispec-only section's files and printed table; a run whose greedy output differs is an error."""
    if spec_rows:
        print()
        print(write_spec(cfg.out, machine, spec_rows))
        if not all(r.identical for r in spec_rows):
            state.errors["spec"] = "a speculative run's greedy output differs from the non-speculative one"
    if adaptive_rows:
        print()
        print(write_adaptive(cfg.out, machine, adaptive_rows, cfg.max_tokens, cfg.runs, cfg.adaptive_queue))
        if not all(r.identical for r in adaptive_rows):
            bad = ", ".join(f"batch {r.batch_size} {r.config}" for r in adaptive_rows if not r.identical)
            state.errors["adaptive"] = f"greedy output differs from the non-speculative one: {bad}"
    for extra in EXTRAS:
        rows = extras.get(extra.scenario)
        if rows is None:
            continue
        print()
        print(extra.write(cfg.out, machine, rows))
        if error := extra.check(rows):
            state.errors[extra.scenario] = error


def run(args: argparse.Namespace) -> int:
    # Never reach for the Hub: every model file here is local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = resolve(args)
    except ValueError as exc:
        log(f"error: {exc}")
        return 2
    began = time.perf_counter()
    import torch

    from verispec.models.cpu_kernels import kernel_build
    from verispec.models.default import default_model_path
    from verispec.models.tokenizer_cache import load_tokenizer

    kernel_build(wait=True)  # an engine would run on torch's kernels while a first build runs: not what is measured
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    threads = torch.get_num_threads()  # llama.cpp gets the same count as torch, for a fair fight
    model_path = default_model_path()
    # verispec's loader caches the converted GGUF tokenizer; transformers' own conversion is slow.
    tokenizer = load_tokenizer(model_path)
    prompts = build_prompts(tokenizer, cfg.scenarios)
    log(f"model {model_path}; {cfg.max_tokens} tokens, {cfg.runs} run(s), {threads} thread(s), "
        f"scenarios {','.join(cfg.scenarios)}, peers {','.join(cfg.peers) or 'none'}")

    # The fidelity check reuses HF's phase; its prompts are the chat set, sized for --quick.
    fidelity_prompts = chat_prompts(tokenizer, fidelity_size(cfg.quick)[0]) if "hf" in cfg.peers else []
    state = RunState(fidelity_prompts=fidelity_prompts)
    if prompts and not _measure_all(cfg, model_path, threads, tokenizer, prompts, state):
        return 1
    spec_rows, adaptive_rows = _sweeps(cfg, state, measured=bool(prompts))
    extras = {x.scenario: _optional(cfg, state, x.scenario, x.announce, lambda x=x: x.measure(cfg, tokenizer, log))
              for x in EXTRAS}
    results, heads = state.results, headlines()
    machine = machine_info(threads)
    outcomes = evaluate(results)
    _print_tables(results, heads, outcomes, state)
    cfg.out.mkdir(parents=True, exist_ok=True)
    _write_sections(cfg, machine, spec_rows, adaptive_rows, extras, state)
    doc = {"machine": machine, "config": _config(cfg, model_path, prompts, state), "skipped": state.skipped, "errors": state.errors,
           "targets": [{"name": o.target.name, "ratio": o.ratio, "status": o.status} for o in outcomes],
           "fidelity": {r.tier: r.to_json() for r in state.fidelity}}
    write_json(cfg.out / "bench.json", doc, results, heads)
    # The same tables as Markdown, ready to paste into docs/benchmarks.md.
    md = [format_table(results, markdown=True, headline=heads), format_ttft_table(results, markdown=True),
          format_targets(outcomes, markdown=True), format_fidelity_table(state.fidelity, markdown=True)]
    (cfg.out / "bench.md").write_text("\n\n".join(m for m in md if m) + "\n")
    if any(r.tokens for r in results):
        plot(cfg.out / "bench.png", results, machine, cfg.max_tokens)
    log(f"wrote bench.json, bench.md and bench.png under {cfg.out}; "
        f"total {time.perf_counter() - began:.0f}s")
    return 1 if state.errors else 0
