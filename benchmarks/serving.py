"""Serving through the same OpenAI client: `verispec serve` against llama.cpp's own `llama-server`
on the bundled file, each a subprocess on this machine's loopback, each at the same thread count.

- `chat x1`, `chat x16`: one, then 16 concurrent chat requests (the benchmark's chat prompts, the
  chat template applied once, sent as /v1/completions text so both servers see the same tokens),
  128 new tokens each, greedy, `ignore_eos`; llama-server with 16 slots (`-np 16`), continuous
  batching, as a user serving 16 clients runs it.
- `extractive`: the ~630-token summary prompt whose answer copies its source, each server with
  its best model-free drafter: verispec's prompt lookup (ngram, k = 5) and llama-server's
  `--spec-type ngram-mod` and `ngram-simple`, the faster of the two reported.

`python -m benchmarks --scenarios serving` (named only: it needs llama.cpp's tools, see
benchmarks/build_llama_cpp.py). Reported: completion tokens per second of wall time from the first
request sent to the last answer received, and verispec's ratio."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.model_1b import llama_cpp_tool
from benchmarks.prompts import chat_prompts, extractive_prompt
from benchmarks.report import write_section
from benchmarks.servers import Server
from verispec import envs

MAX_TOKENS = 128
LLAMA_SPEC_TYPES = ("ngram-mod", "ngram-simple")


@dataclass(slots=True)
class ServingRow:
    workload: str
    threads: int
    verispec: float  # completion tokens / s
    llama_server: float | None
    llama_setting: str = ""


def _complete(server: Server, prompt: str) -> int:
    """One greedy completion of MAX_TOKENS; returns its completion tokens."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return int(server.post("/v1/completions", body)["usage"]["completion_tokens"])


def _throughput(server: Server, prompts: list[str]) -> float:
    """Completion tokens per second, all prompts sent at once."""
    _complete(server, prompts[0][:64])  # a warm-up request
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(lambda p: _complete(server, p), prompts))
    return tokens / (time.perf_counter() - start)


def _verispec_args(model: str, threads: int, spec: bool) -> list[str]:
    args = [sys.executable, "-m", "verispec", "serve", "--model", model, "--port", "{port}",
            "--num-threads", str(threads), "--log-level", "warning"]
    return args + (["--speculative-method", "ngram", "--num-speculative-tokens", "5"] if spec else [])


def _llama_args(tool: Path, model: str, threads: int, slots: int, spec_type: str | None) -> list[str]:
    args = [str(tool), "-m", model, "--port", "{port}", "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(1024 * slots), "-cb"]
    return args + (["--spec-type", spec_type, "--spec-draft-n-max", "5"] if spec_type else [])


def _measure(args: list[str], prompts: list[str], log: Path) -> float:
    server = Server(args, log).wait_ready()
    try:
        return _throughput(server, prompts)
    finally:
        server.stop()


def run_serving(threads_list: tuple[int, ...], out: Path, log: Callable[[str], None]) -> list[ServingRow]:
    from verispec.models.default import default_model_path
    from verispec.models.tokenizer_cache import load_tokenizer

    model = default_model_path()
    tok = load_tokenizer(model)
    tool = llama_cpp_tool("llama-server")
    if tool is None:
        log(f"llama-server is not built: `python -m benchmarks.build_llama_cpp`, then set {envs.LLAMA_CPP}; "
            "its column stays empty")
    chats = [p.text for p in chat_prompts(tok, 16)]
    extractive = [extractive_prompt(tok).text]
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for threads in threads_list:
        for name, prompts, spec in (("chat x1", chats[:1], False), ("chat x16", chats, False),
                                    ("extractive", extractive, True)):
            log(f"serving: {name} at {threads} thread(s)")
            ours = _measure(_verispec_args(model, threads, spec), prompts, out / "serve-verispec.log")
            theirs, setting = None, ""
            if tool is not None:
                types = LLAMA_SPEC_TYPES if spec else (None,)
                speeds = {t: _measure(_llama_args(tool, model, threads, len(prompts), t), prompts,
                                      out / "serve-llama.log") for t in types}
                best = max(speeds, key=speeds.get)
                theirs, setting = speeds[best], f"-np {len(prompts)}" + (f", --spec-type {best}" if best else "")
            rows.append(ServingRow(name, threads, ours, theirs, setting))
    return rows


def format_serving(rows: list[ServingRow]) -> str:
    lines = ["| workload | threads | verispec serve tok/s | llama-server tok/s (setting) | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        theirs = f"{r.llama_server:.1f} ({r.llama_setting})" if r.llama_server else "-"
        ratio = f"{r.verispec / r.llama_server:.2f}x" if r.llama_server else "-"
        lines.append(f"| {r.workload} | {r.threads} | {r.verispec:.1f} | {theirs} | {ratio} |")
    return "\n".join(lines)


def write_serving(out: Path, machine: dict[str, Any], rows: list[ServingRow]) -> str:
    return write_section(out, "serving", format_serving(rows), {"machine": machine, "rows": [asdict(r) for r in rows]})
