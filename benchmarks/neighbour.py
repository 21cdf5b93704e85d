"""Decode beside a busy neighbour: one other process of the same priority spinning on a core, as a
server that shares its machine meets it (verispec only, and llama-bench where it is built).

The bundled model's decode (128 tokens after an 8-token prompt, the fast tier; llama-bench's
tg128 on the same file), each figure from a fresh process (benchmarks/formats.py's child):
- one thread and two threads on the quiet machine;
- two threads beside the neighbour, as verispec runs by default (its threads follow the cores the
  others leave: verispec/cores.py), and with that off (verispec/envs.py's adaptive threads at 0), where every
  parallel region waits for a thread the neighbour has descheduled.
The ratio that matters: two threads beside the neighbour over one quiet thread (the issue's bar:
0.9x). `python -m benchmarks --scenarios neighbour`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.formats import llama_bench
from benchmarks.model_1b import llama_cpp_tool
from benchmarks.report import write_section
from verispec import envs

@dataclass(slots=True)
class NeighbourRow:
    system: str  # verispec, verispec (threads fixed), llama-bench
    threads: int
    neighbour: bool
    decode: float  # tokens/s


@contextmanager
def busy_neighbour(on: bool):
    """One process of our priority spinning for as long as the block runs (none unless `on`)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield proc
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def _verispec(path: str, threads: int, adaptive: bool) -> float:
    env = {**os.environ, envs.ADAPTIVE_THREADS: "1" if adaptive else "0"}
    cmd = [sys.executable, "-m", "benchmarks.formats", "--child", path, str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["decode"]


def run_neighbour(quick: bool, log: Callable[[str], None]) -> list[NeighbourRow]:
    from verispec.models.default import default_model_path

    path = str(default_model_path())
    cases = [("verispec", 1, False, True), ("verispec", 2, False, True), ("verispec", 2, True, True),
             ("verispec (threads fixed)", 2, True, False)]
    rows = []
    for system, threads, neighbour, adaptive in cases:
        log(f"neighbour: {system}, {threads} thread(s), {'beside a busy process' if neighbour else 'quiet'}")
        with busy_neighbour(neighbour):
            rows.append(NeighbourRow(system, threads, neighbour, _verispec(path, threads, adaptive)))
    if llama_cpp_tool("llama-bench") is None:
        log(f"llama.cpp's tools are not built (set {envs.LLAMA_CPP}): no llama-bench rows")
    elif not quick:
        for threads, neighbour in ((1, False), (2, False), (2, True)):
            with busy_neighbour(neighbour):
                rows.append(NeighbourRow("llama-bench", threads, neighbour, llama_bench(path, threads, prompt=0)[0] or 0.0))
    return rows


def format_neighbour(rows: list[NeighbourRow]) -> str:
    quiet_one = {r.system.split(" ")[0]: r.decode for r in rows if r.threads == 1 and not r.neighbour}
    lines = ["| system | threads | beside a busy process | decode tok/s | / one quiet thread |",
             "|---|---|---|---|---|"]
    for r in rows:
        base = quiet_one.get(r.system.split(" ")[0])
        ratio = f"{r.decode / base:.2f}x" if base else "-"
        lines.append(f"| {r.system} | {r.threads} | {'yes' if r.neighbour else 'no'} | {r.decode:.1f} | {ratio} |")
    return "\n".join(lines)


def write_neighbour(out: Path, machine: dict[str, Any], rows: list[NeighbourRow]) -> str:
    return write_section(out, "neighbour", format_neighbour(rows),
                         {"machine": machine, "rows": [asdict(r) for r in rows]})
