"""`verispec bench`: tok/s of verispec against HF transformers and llama.cpp on the bundled model.

All systems run the same chat prompts on SmolLM2-135M-Instruct, greedy, with exactly
`max_tokens` new tokens per prompt, one system loaded at a time (so they never compete for the
cores). Each figure is the median of `runs` timed runs after one untimed warm-up; the table also
says whether each peer's greedy output equals verispec's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verispec.bench.peers import PEERS, Generation, PeerUnavailable, System, load_system
from verispec.bench.prompts import Prompt, chat_prompts
from verispec.bench.spec import format_spec_table, plot_spec, run_sweep, spec_json
from verispec.bench.report import (
    BUSY_CORES,
    Result,
    format_ratios,
    format_table,
    machine_info,
    plot,
    write_json,
)

# Scenario name -> number of distinct prompts submitted at once.
SCENARIOS: dict[str, int] = {"single": 1, "batch16": 16, "batch16_logprobs": 16}
# The speculative sweep (verispec only, its own prompt set): see verispec/bench/spec.py.
SPEC_SCENARIO = "spec"
# verispec-only scenarios and the SamplingParams extras they add: the cost of logprobs=20 is
# read against verispec's own batch16 figure from the same run.
VERISPEC_ONLY: dict[str, dict[str, int]] = {"batch16_logprobs": {"logprobs": 20}}
DEFAULT_MAX_TOKENS, DEFAULT_RUNS = 128, 3
QUICK_MAX_TOKENS, QUICK_RUNS = 32, 1
# The warm-up only has to touch every code path (prefill, decode, allocator, thread pools), not
# to be long: a few tokens of the real scenario do that and keep --quick quick.
WARMUP_TOKENS = 8


@dataclass(slots=True)
class BenchConfig:
    quick: bool
    peers: list[str]
    out: Path
    max_tokens: int
    runs: int
    scenarios: list[str]
    threads: int | None


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_MAX_TOKENS} tokens, {QUICK_RUNS} run (under 3 minutes)")
    parser.add_argument("--peers", default="hf,llamacpp",
                        help=f"comma list of peers to compare with: {','.join(PEERS)}, or 'none' (default: %(default)s)")
    parser.add_argument("--out", default="bench-out", metavar="DIR",
                        help="where bench.json and bench.png go (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"new tokens per prompt (default {DEFAULT_MAX_TOKENS}; {QUICK_MAX_TOKENS} with --quick)")
    parser.add_argument("--runs", type=int, default=None,
                        help=f"timed runs per figure, median reported (default {DEFAULT_RUNS}; {QUICK_RUNS} with --quick)")
    parser.add_argument("--scenarios", default=",".join([*SCENARIOS, SPEC_SCENARIO]),
                        help="comma list of scenarios (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for every system (default: torch's default, normally all cores)")


def _split(value: str) -> list[str]:
    return list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))


def _resolve(args: argparse.Namespace) -> BenchConfig:
    quick = bool(getattr(args, "quick", False))
    peers = _split(getattr(args, "peers", "hf,llamacpp") or "")
    peers = [] if peers == ["none"] else peers
    scenarios = _split(getattr(args, "scenarios", None) or ",".join([*SCENARIOS, SPEC_SCENARIO]))
    # None means "not given": --quick changes the defaults but never an explicit value (0 included,
    # which is then rejected below rather than silently replaced).
    max_tokens = getattr(args, "max_tokens", None)
    max_tokens = (QUICK_MAX_TOKENS if quick else DEFAULT_MAX_TOKENS) if max_tokens is None else max_tokens
    runs = getattr(args, "runs", None)
    runs = (QUICK_RUNS if quick else DEFAULT_RUNS) if runs is None else runs
    threads = getattr(args, "threads", None)
    if bad := [p for p in peers if p not in PEERS]:
        raise ValueError(f"unknown peer(s) {', '.join(bad)}; choose from {', '.join(PEERS)} or 'none'")
    if bad := [s for s in scenarios if s not in SCENARIOS and s != SPEC_SCENARIO]:
        raise ValueError(f"unknown scenario(s) {', '.join(bad)}; choose from {', '.join([*SCENARIOS, SPEC_SCENARIO])}")
    if not scenarios:
        raise ValueError("--scenarios names no scenario")
    if max_tokens < 1 or runs < 1 or (threads is not None and threads < 1):
        raise ValueError("--max-tokens, --runs and --threads must be >= 1")
    return BenchConfig(quick, peers, Path(getattr(args, "out", "bench-out")), max_tokens, runs, scenarios, threads)


def _busy_seconds() -> float | None:
    """CPU seconds all processes have used so far (from /proc/stat); None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _self_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _compare(system: System, gen: Generation, ref: Generation | None) -> str:
    """'yes'/'no (k/n ...)' against verispec's greedy output, or 'n/a' where not comparable."""
    if system.key == "verispec":
        return "reference"
    if ref is None:
        return "n/a"
    if system.compare == "ids" and gen.token_ids is not None and ref.token_ids is not None:
        pairs = list(zip(gen.token_ids, ref.token_ids))
        same = sum(a == b for a, b in pairs)
        if same == len(pairs):
            return "yes (ids)"
        # Where the first mismatch falls tells a near-tie late in the text from a real bug.
        first = min(next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y) for a, b in pairs if a != b)
        return f"no ({same}/{len(pairs)} ids, first diff at token {first})"
    if system.compare == "text":
        same = sum(a == b for a, b in zip(gen.texts, ref.texts))
        return f"{'yes' if same == len(gen.texts) else 'no'} ({same}/{len(gen.texts)} text)"
    return "n/a"


def _measure(system: System, scenario: str, prompts: list[Prompt], cfg: BenchConfig,
             refs: dict[str, Generation]) -> Result:
    res = Result(system.key, system.label, scenario, len(prompts), cfg.max_tokens)
    extra = VERISPEC_ONLY.get(scenario, {})
    system.generate(prompts, min(WARMUP_TOKENS, cfg.max_tokens), **extra)  # warm-up, not timed
    gen: Generation | None = None
    for i in range(cfg.runs):
        busy, mine, start = _busy_seconds(), _self_seconds(), time.perf_counter()
        gen = system.generate(prompts, cfg.max_tokens, **extra)
        wall = time.perf_counter() - start
        after = _busy_seconds()
        res.seconds.append(wall)
        res.tokens.append(sum(gen.lengths))
        if busy is not None and after is not None:
            # Everyone's CPU time minus ours = what other processes took from the benchmark.
            res.others_load.append(max(0.0, (after - busy) - (_self_seconds() - mine)) / wall)
        log(f"  {system.label} {scenario} run {i + 1}/{cfg.runs}: {res.tokens[-1]} tokens in {wall:.2f}s = "
            f"{res.tok_s[-1]:.1f} tok/s" + (f", other processes used {res.others_load[-1]:.2f} cores"
                                            if res.others_load else ""))
    assert gen is not None
    res.short = sum(1 for n in gen.lengths if n < cfg.max_tokens)
    if system.key == "verispec":
        refs[scenario] = gen
    res.equal = _compare(system, gen, refs.get(scenario))
    log(f"  {system.label} {scenario} first output: {gen.texts[0][:70]!r}")
    return res


def _logprobs_share(results: list[Result]) -> float | None:
    by = {r.scenario: r.median for r in results if r.system == "verispec" and r.tokens}
    if "batch16" in by and "batch16_logprobs" in by:
        return by["batch16_logprobs"] / by["batch16"]
    return None


def run(args: argparse.Namespace) -> int:
    # Never reach for the Hub: every model file here is local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = _resolve(args)
    except ValueError as exc:
        log(f"error: {exc}")
        return 2
    began = time.perf_counter()
    import torch

    from verispec.models.default import default_model_path
    from verispec.models.loader import load_tokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    threads = torch.get_num_threads()  # llama.cpp gets the same count as torch, for a fair fight
    model_path = default_model_path()
    # verispec's loader caches the converted GGUF tokenizer; transformers' own conversion is slow.
    tokenizer = load_tokenizer(model_path)
    plain = [s for s in cfg.scenarios if s in SCENARIOS]
    prompts = chat_prompts(tokenizer, max([SCENARIOS[s] for s in plain], default=1))
    log(f"model {model_path}; {cfg.max_tokens} tokens, {cfg.runs} run(s), {threads} thread(s), "
        f"scenarios {','.join(cfg.scenarios)}, peers {','.join(cfg.peers) or 'none'}")

    results: list[Result] = []
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    refs: dict[str, Generation] = {}
    for key in ["verispec", *cfg.peers] if plain else []:
        label = PEERS[key].label if key in PEERS else key
        log(f"loading {label} ...")
        start = time.perf_counter()
        try:
            system = load_system(key, model_path, threads, tokenizer, log)
        except PeerUnavailable as exc:
            skipped[key] = str(exc)
            log(f"skipping {label}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - a broken peer must not hide the others' results
            errors[key] = f"load failed: {exc!r}"
            log(f"{label} failed to load:\n{traceback.format_exc()}")
            if key == "verispec":
                return 1  # nothing to compare against
            continue
        log(f"{label} loaded in {time.perf_counter() - start:.1f}s")
        try:
            for scenario in plain:
                if scenario in VERISPEC_ONLY and key != "verispec":
                    continue
                results.append(_measure(system, scenario, prompts[: SCENARIOS[scenario]], cfg, refs))
        except Exception as exc:  # noqa: BLE001 - same: record it, go on with the next system
            errors[key] = f"run failed: {exc!r}"
            log(f"{label} failed:\n{traceback.format_exc()}")
        finally:
            system.close()
            del system
            gc.collect()  # free one model's memory before the next system loads

    spec_rows = []
    if SPEC_SCENARIO in cfg.scenarios:
        log("speculative decoding sweep (verispec, batch 1) ...")
        spec_rows = run_sweep(cfg.max_tokens, cfg.quick, log)
    machine = machine_info(threads)
    config: dict[str, Any] = {
        "model": model_path,
        "quick": cfg.quick,
        "max_tokens": cfg.max_tokens,
        "runs": cfg.runs,
        "warmup_tokens": min(WARMUP_TOKENS, cfg.max_tokens),
        "scenarios": {s: SCENARIOS.get(s, 1) for s in cfg.scenarios},
        "peers": cfg.peers,
        "sampling": "greedy; EOS forbidden so each prompt yields exactly max_tokens tokens",
        "verispec_only": VERISPEC_ONLY,
        "logprobs20_share_of_batch16": _logprobs_share(results),
    }
    print(format_table(results))
    if any(r.others_load and max(r.others_load) > BUSY_CORES for r in results):
        print(f"(busy): other processes used over {BUSY_CORES} cores during a run; that figure is suspect")
    if summary := format_ratios(results):
        print()
        print(summary)
    overhead = _logprobs_share(results)
    if overhead is not None:
        print(f"verispec throughput with logprobs=20: {overhead:.1%} of the same batch without logprobs")
    for key, why in {**skipped, **errors}.items():
        print(f"{key}: {why}")
    cfg.out.mkdir(parents=True, exist_ok=True)
    if spec_rows:
        table = format_spec_table(spec_rows)
        print()
        print(table)
        (cfg.out / "spec.md").write_text(table + "\n")
        (cfg.out / "spec.json").write_text(json.dumps({"machine": machine, "rows": spec_json(spec_rows)}, indent=2))
        plot_spec(cfg.out / "spec.png", spec_rows)
        if not all(r.identical for r in spec_rows):
            errors["spec"] = "a speculative run's greedy output differs from the non-speculative one"
    write_json(cfg.out / "bench.json", machine, config, results, skipped, errors)
    # The same table as Markdown, ready to paste into docs/benchmarks.md.
    (cfg.out / "bench.md").write_text(format_table(results, markdown=True) + "\n")
    if any(r.tokens for r in results):
        plot(cfg.out / "bench.png", results, machine, cfg.max_tokens)
    log(f"wrote bench.json, bench.md and bench.png under {cfg.out}; "
        f"total {time.perf_counter() - began:.0f}s")
    return 1 if errors else 0
