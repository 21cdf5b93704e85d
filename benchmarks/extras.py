"""The verispec-only scenarios that run after the systems' tables, each with its own measurement,
report and check: prefix caching, structured output, tensor parallelism, the cost curve, weight
updates, suffix decoding, DSpark drafting, a busy neighbour, real files, serving and start-up (the last three named only). One entry per scenario, so the runner loops instead of naming each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.cost_curve import run_cost_curve, write_curve
from benchmarks.dspark import run_dspark, write_dspark
from benchmarks.formats import run_formats, write_formats
from benchmarks.neighbour import run_neighbour, write_neighbour
from benchmarks.options import BenchConfig
from benchmarks.prefix import run_prefix, write_prefix
from benchmarks.serving import run_serving, write_serving
from benchmarks.scaling import run_scaling, write_scaling
from benchmarks.scenarios import (
    COST_SCENARIO, DSPARK_SCENARIO, FORMATS_SCENARIO, NEIGHBOUR_SCENARIO, PREFIX_SCENARIO, SCALING_SCENARIO, SERVING_SCENARIO, STRUCTURED_SCENARIO,
    STARTUP_SCENARIO, SUFFIX_SCENARIO, WEIGHTS_SCENARIO,
)
from benchmarks.startup import run_startup, write_startup
from benchmarks.structured import run_structured, write_structured
from benchmarks.suffix import run_suffix, write_suffix
from benchmarks.weights import run_weights, write_weights

Log = Callable[[str], None]


def _no_check(rows: Any) -> str | None:
    return None


def _suffix_check(rows: Any) -> str | None:
    if any(r.identical == "NO" for r in rows):
        return "a speculative run's greedy output differs from the plain one"
    return None


def _dspark_check(results: Any) -> str | None:
    return _suffix_check(results["rows"])


@dataclass(frozen=True, slots=True)
class Extra:
    scenario: str
    announce: str  # the log line as it starts
    summary: str  # bench.json's description of the scenario
    measure: Callable[[BenchConfig, Any, Log], Any]  # (config, tokenizer, log) -> its results
    write: Callable[[Path, dict[str, Any], Any], str]  # (out, machine, results) -> the printed table
    check: Callable[[Any], str | None] = _no_check  # an error to record, where the results show one


EXTRAS: tuple[Extra, ...] = (
    Extra(PREFIX_SCENARIO, "prefix caching: cache on against cache off (verispec, two HTTP servers, then in process)",
          "prefix caching, cache on against off",
          lambda c, tok, log: run_prefix(tok, c.quick, c.max_tokens, c.runs, c.out, log), write_prefix),
    Extra(STRUCTURED_SCENARIO, "structured output: a grammar against none (verispec, in process)",
          "structured output, a grammar against none",
          lambda c, tok, log: run_structured(tok, c.quick, c.max_tokens, c.runs, log), write_structured),
    Extra(SCALING_SCENARIO, "tensor parallelism: two ranks against one on this machine (verispec, in process)",
          "tensor parallelism, two ranks against one",
          lambda c, tok, log: run_scaling(tok, c.quick, log), write_scaling),
    Extra(COST_SCENARIO, "the cost curve: step time against rows per tier and kernel (verispec, in process)",
          "step time against rows", lambda c, tok, log: run_cost_curve(c.quick, log), write_curve),
    Extra(WEIGHTS_SCENARIO, "weight updates in place against a fresh engine (verispec, in process)",
          "weight updates in place", lambda c, tok, log: run_weights(c.quick, log), write_weights),
    Extra(SUFFIX_SCENARIO, "suffix decoding against ngram and plain: agent loop, code edit, RL rollouts "
          "(verispec, in process)", "suffix decoding, three workloads",
          lambda c, tok, log: run_suffix(c.quick, c.max_tokens, c.runs, log), write_suffix, _suffix_check),
    Extra(DSPARK_SCENARIO, "DSpark drafting against plain, ngram and suffix on chat questions it never trained on "
          "(verispec, in process)", "DSpark drafting on chat, greedy and T=0.8, batch 1 and 16",
          lambda c, tok, log: run_dspark(c.quick, c.max_tokens, c.threads, log), write_dspark, _dspark_check),
    Extra(NEIGHBOUR_SCENARIO, "decode beside a busy process of the same priority against the quiet machine "
          "(fresh processes)", "decode beside a busy neighbour, 1 and 2 threads",
          lambda c, tok, log: run_neighbour(c.quick, log), write_neighbour),
    Extra(FORMATS_SCENARIO, "real files: a 1B model in Q4_K_M, Q4_0 and Q8_0 against llama-bench (fresh processes)",
          "GGUF types on a 1B model against llama-bench",
          lambda c, tok, log: run_formats(c.quick, log), write_formats),
    Extra(SERVING_SCENARIO, "serving: verispec serve against llama-server, one OpenAI client (subprocesses)",
          "verispec serve against llama-server -np 16",
          lambda c, tok, log: run_serving((c.threads or 1,) if c.quick else (1, 2), c.out, log), write_serving),
    Extra(STARTUP_SCENARIO, "start-up: cold, a new file, warm, another thread count, generate and serve (fresh "
          "processes)", "start-up phases, first token and the compiled step",
          lambda c, tok, log: run_startup(c.quick, c.threads or 2, log), write_startup),
)
