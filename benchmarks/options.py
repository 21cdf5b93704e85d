"""`python -m benchmarks`'s options: the command line and what it resolves to."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from benchmarks.scenarios import ALL_SCENARIOS, NAMED_ONLY
from benchmarks.system import PEERS

DEFAULT_MAX_TOKENS, DEFAULT_RUNS = 128, 3
QUICK_MAX_TOKENS, QUICK_RUNS = 32, 1


@dataclass(slots=True)
class BenchConfig:
    quick: bool
    peers: list[str]
    out: Path
    max_tokens: int
    runs: int
    scenarios: list[str]
    threads: int | None
    adaptive_queue: int = 1  # adaptive sweep: requests per batch slot (1: one fixed batch)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_MAX_TOKENS} tokens, {QUICK_RUNS} run (about 3 minutes)")
    parser.add_argument("--peers", default="hf,llamacpp",
                        help=f"comma list of peers to compare with: {','.join(PEERS)}, or 'none' (default: %(default)s)")
    parser.add_argument("--out", default="bench-out", metavar="DIR",
                        help="where bench.json, bench.md and bench.png go (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"new tokens per prompt (default {DEFAULT_MAX_TOKENS}; {QUICK_MAX_TOKENS} with --quick)")
    parser.add_argument("--runs", type=int, default=None,
                        help=f"timed runs per figure, median reported (default {DEFAULT_RUNS}; {QUICK_RUNS} with --quick)")
    parser.add_argument("--scenarios", default=",".join(ALL_SCENARIOS),
                        help="comma list of scenarios (default: %(default)s; named only: formats, a 1B model's "
                             "GGUF types against llama-bench, and serving, verispec serve against llama-server)")
    parser.add_argument("--adaptive-queue", type=int, default=1, metavar="N",
                        help="adaptive sweep: submit N x batch requests with at most `batch` running at once "
                             "(continuous batching), instead of one fixed batch (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for every system (default: torch's default, normally all cores)")


def _split(value: str) -> list[str]:
    return list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))


def resolve(args: argparse.Namespace) -> BenchConfig:
    quick = bool(getattr(args, "quick", False))
    peers = _split(getattr(args, "peers", "hf,llamacpp") or "")
    peers = [] if peers == ["none"] else peers
    scenarios = _split(getattr(args, "scenarios", None) or ",".join(ALL_SCENARIOS))
    # None means "not given": --quick changes the defaults but never an explicit value (0 included,
    # which is then rejected below rather than silently replaced).
    max_tokens = getattr(args, "max_tokens", None)
    max_tokens = (QUICK_MAX_TOKENS if quick else DEFAULT_MAX_TOKENS) if max_tokens is None else max_tokens
    runs = getattr(args, "runs", None)
    runs = (QUICK_RUNS if quick else DEFAULT_RUNS) if runs is None else runs
    threads = getattr(args, "threads", None)
    if bad := [p for p in peers if p not in PEERS]:
        raise ValueError(f"unknown peer(s) {', '.join(bad)}; choose from {', '.join(PEERS)} or 'none'")
    if bad := [s for s in scenarios if s not in (*ALL_SCENARIOS, *NAMED_ONLY)]:
        raise ValueError(f"unknown scenario(s) {', '.join(bad)}; choose from {', '.join((*ALL_SCENARIOS, *NAMED_ONLY))}")
    if not scenarios:
        raise ValueError("--scenarios names no scenario")
    queue = getattr(args, "adaptive_queue", 1)
    if max_tokens < 1 or runs < 1 or queue < 1 or (threads is not None and threads < 1):
        raise ValueError("--max-tokens, --runs, --adaptive-queue and --threads must be >= 1")
    return BenchConfig(quick, peers, Path(getattr(args, "out", "bench-out")), max_tokens, runs, scenarios, threads,
                       queue)
