"""Real files: the 1B-class model (benchmarks/model_1b.py) in Q4_K_M, Q4_0 and Q8_0, verispec's fast
tier against llama.cpp's `llama-bench` on the same file, at 1 and 2 threads: decode (128 tokens
after an 8-token prompt, llama-bench's tg128), prefill (512 tokens, pp512), the memory verispec
holds beyond its runtime and the time from a warm start to the first token.

`python -m benchmarks --scenarios formats` (not in the default set: it writes a 2 GB model once).
Each verispec figure comes from a fresh child process (`--child`), so its peak memory is its own.
Without llama.cpp's tools (verispec/envs.py's variable, see benchmarks/build_llama_cpp.py) the peer's
columns are empty and the log says how to build them."""

from __future__ import annotations

import importlib
import json
import random
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.model_1b import SCHEMES, llama_cpp_tool, model_1b
from benchmarks.report import write_section
from verispec import envs

THREADS = (1, 2)
PROMPT, DECODE = 512, 128


@dataclass(slots=True)
class FormatRow:
    scheme: str
    threads: int
    file_mib: float
    decode: float  # verispec tokens/s
    prefill: float
    ready_s: float  # engine start to first token, warm caches
    held_mib: float  # resident memory beyond the runtime and the KV pool, at the first token
    peak_mib: float  # peak resident memory beyond the runtime and the KV pool
    step: str  # the kernels (and packed variant) and whether the step ran compiled
    llama_decode: float | None = None  # llama-bench tg128
    llama_prefill: float | None = None  # llama-bench pp512


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def child(path: str, threads: int) -> dict[str, float]:
    """One fresh engine on `path`: start, first token, prefill and decode timed; memory read."""
    import torch

    torch.set_num_threads(threads)
    from verispec import LLM, SamplingParams

    importlib.import_module("transformers")  # part of the runtime: the tokenizer's library

    runtime = _rss_mib()
    start = time.perf_counter()
    llm = LLM(path, num_kv_blocks=64, max_num_seqs=4)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], one, use_tqdm=False)
    ready = time.perf_counter() - start
    # The steady state: the compiled step (a first run for this file and thread count compiles it
    # in the background; measured beside that compile, the step would share the cores with it).
    compiled = llm.engine.wait_for_compiled_step(900)
    cfg = llm.engine.model.cfg  # the KV pool: k and v, bf16, per layer
    kv = 64 * llm.engine.pool.block_size * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 2 / 2**20
    held = _rss_mib() - runtime - kv
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(PROMPT)]
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
    prefill = PROMPT / (time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt[:8]}], SamplingParams(temperature=0, max_tokens=DECODE + 1,
                                                                    ignore_eos=True), use_tqdm=False)
    decode = DECODE / (time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - runtime - kv
    step = f"{llm.engine.runtime.kernels}, {'compiled' if compiled else 'eager'}"
    return {"decode": decode, "prefill": prefill, "ready_s": ready, "held_mib": held, "peak_mib": peak, "step": step}


def _verispec(path: Path, threads: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.formats", "--child", str(path), str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_bench(path: Path, threads: int, prompt: int = PROMPT) -> tuple[float | None, float | None]:
    """llama-bench's tg (DECODE tokens) and pp (`prompt` tokens; 0: not run) tokens/s on `path`."""
    bench = llama_cpp_tool("llama-bench")
    if bench is None:
        return None, None
    res = subprocess.run([str(bench), "-m", str(path), "-t", str(threads), "-p", str(prompt), "-n", str(DECODE),
                          "-r", "2", "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(res.stdout)
    speed = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
    return speed.get("tg"), speed.get("pp")


def run_formats(quick: bool, log: Callable[[str], None]) -> list[FormatRow]:
    from verispec.models.default import default_model_path

    if llama_cpp_tool("llama-bench") is None:
        log("llama.cpp's tools are not built: `python -m benchmarks.build_llama_cpp` (about 20 minutes, once), "
            f"then set {envs.LLAMA_CPP} as it prints; the peer's columns stay empty")
    rows = []
    for scheme in SCHEMES[:1] if quick else SCHEMES:
        path = model_1b(scheme, default_model_path(), log=log)
        for threads in THREADS[:1] if quick else THREADS:
            log(f"formats: {scheme} at {threads} thread(s)")
            row = FormatRow(scheme, threads, path.stat().st_size / 2**20, **_verispec(path, threads))
            row.llama_decode, row.llama_prefill = llama_bench(path, threads)
            rows.append(row)
    return rows


def _ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "-"


def format_formats(rows: list[FormatRow]) -> str:
    lines = ["| file | threads | decode tok/s (llama-bench) | ratio | prefill 512 tok/s (llama-bench) | ratio | "
             "held / peak MiB beyond runtime + KV (file) | warm start to first token | verispec's step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ld = f"{r.llama_decode:.2f}" if r.llama_decode else "-"
        lp = f"{r.llama_prefill:.1f}" if r.llama_prefill else "-"
        lines.append(f"| 1B {r.scheme} | {r.threads} | {r.decode:.2f} ({ld}) | {_ratio(r.decode, r.llama_decode)} | "
                     f"{r.prefill:.1f} ({lp}) | {_ratio(r.prefill, r.llama_prefill)} | "
                     f"{r.held_mib:.0f} / {r.peak_mib:.0f} ({r.file_mib:.0f}) | {r.ready_s:.1f} s | {r.step} |")
    return "\n".join(lines)


def write_formats(out: Path, machine: dict[str, Any], rows: list[FormatRow]) -> str:
    return write_section(out, "formats", format_formats(rows), {"machine": machine, "rows": [asdict(r) for r in rows]})


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    print(json.dumps(child(sys.argv[2], int(sys.argv[3]))))
elif __name__ == "__main__":
    sys.exit("usage: python -m benchmarks --scenarios formats")
