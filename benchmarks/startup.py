"""Start-up, in fresh processes (verispec only; named only, since a cold row rebuilds the kernels):
how long from a process's start until it answers, split into phases, and until its step runs
compiled, on the bundled model. Rows:

- cold: an empty cache (GGUF index and tokenizer read; the kernels build in the background, and
  the row waits for them);
- cold, second start: the same cache, the kernels built (the graphs compile in the background);
- new file: the same model copied to a path never loaded, with the kernels built (the index and
  graphs from nothing, the tokenizer found by its vocabulary; the graphs' key is the layer
  shapes, so an identical file's saved graphs would serve it: the Inductor cache is emptied too);
- warm: the same file again;
- threads: warm, at another `num_threads` (the graphs do not depend on it);
- `verispec generate --max-tokens 32`, end to end, warm (the README's first command);
- `verispec serve`, process start to `/health` 200, warm;
- the 1B Q4_K_M benchmark file, new (kernels built, an empty Inductor cache), then warm, then new
  in each exact tier (the decoded values; on the codes);
- a tiny Gemma 3 (benchmarks/model_gemma3.py), new, then warm;
- where llama.cpp is built, its `llama-server` on the same files (the peer a user would pick):
  process start to `/health` 200 (the command column) and to a one-token completion.

Each in-process row runs `_PROBE` in a child: import, engine, the first token, 32 tokens, the
compiled step ready (its worker's compile included, in the background).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.report import write_section

_PROBE = """
import json, sys, time
t0 = time.perf_counter()
from verispec import LLM, SamplingParams
t1 = time.perf_counter()
tier = dict(zip(("dtype", "quantization"), sys.argv[3:]))  # none: the fast tier
llm = LLM(sys.argv[1], num_threads=int(sys.argv[2]), **tier)
t2 = time.perf_counter()
llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
t4 = time.perf_counter()
compiled = llm.engine.wait_for_compiled_step(600)
t5 = time.perf_counter()
kernels = None
if llm.engine.runtime.kernels.startswith("off (building"):  # a first build, in its own process
    from verispec.models.kernel_compiler import building_pid
    while building_pid() is not None:
        time.sleep(0.5)
    kernels = time.perf_counter() - t0
print(json.dumps({"import": t1 - t0, "engine": t2 - t1, "first_token": t3 - t0, "tokens_32": t4 - t3,
                  "compiled": t5 - t0 if compiled else None, "kernels": kernels,
                  "phases": llm.engine.startup.summary()}))
"""


@dataclass(slots=True)
class StartupRow:
    scenario: str
    threads: int
    import_s: float | None = None
    engine_s: float | None = None
    first_token_s: float | None = None  # from the process's start
    tokens_32_s: float | None = None
    compiled_s: float | None = None  # from the process's start until the step runs compiled
    kernels_s: float | None = None  # a first start: from the process's start until the kernels' background build ends
    wall_s: float | None = None  # for the CLI rows: the whole command
    phases: str = ""


def _env(cache: Path, inductor: Path | None = None) -> dict[str, str]:
    from verispec import envs

    env = {**os.environ, envs.CACHE: str(cache), envs.COMPILE: "1", "HF_HUB_OFFLINE": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if inductor is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    return env


def _probe(scenario: str, model: str, threads: int, env: dict[str, str], tier: tuple[str, ...] = ()) -> StartupRow:
    """tier: ("float32",) the exact tier (the decoded values), ("float32", "gguf") the exact tier on
    the file's codes; () the fast tier."""
    run = subprocess.run([sys.executable, "-c", _PROBE, model, str(threads), *tier], env=env,
                         capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"startup probe {scenario} failed: {run.stderr[-1000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return StartupRow(scenario, threads, got["import"], got["engine"], got["first_token"], got["tokens_32"],
                      got["compiled"], got["kernels"], phases=got["phases"])


def _wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, capture_output=True, check=True, timeout=1800)
    return time.perf_counter() - start


def _serve_to_health(env: dict[str, str], port: int = 8765) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "verispec", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return _poll_health(f"http://127.0.0.1:{port}", start)
    finally:
        proc.terminate()
        proc.wait(30)


def _llama_server(model: str, threads: int) -> StartupRow | None:
    """llama.cpp's own server on the same file, where it is built (benchmarks/build_llama_cpp.py):
    process start to /health 200, and to the first token of a one-token completion."""
    from benchmarks.model_1b import llama_cpp_tool

    tool = llama_cpp_tool("llama-server")
    if tool is None:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen([str(tool), "-m", model, "-t", str(threads), "--port", str(port), "-c", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        health = _poll_health(url, start)
        body = json.dumps({"prompt": "The capital of France is", "n_predict": 1}).encode()
        request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            r.read()
        return StartupRow(f"llama-server (peer), {Path(model).name}", threads,
                          first_token_s=time.perf_counter() - start, wall_s=health)
    finally:
        proc.terminate()
        proc.wait(30)


def _poll_health(url: str, start: float) -> float:
    while time.perf_counter() - start < 600:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer /health within 600 s")


def run_startup(quick: bool, threads: int, log: Callable[[str], None]) -> list[StartupRow]:
    from verispec.models.default import default_model_path

    model = default_model_path()
    root = Path(tempfile.mkdtemp(prefix="verispec-startup-"))
    rows: list[StartupRow] = []
    try:
        cold = root / "cold"
        if not quick:
            log("startup: cold (an empty cache: the kernels build in the background)")
            rows.append(_probe("cold (empty cache)", model, threads, _env(cold)))
            log("startup: cold, the second start (the kernels built: the step compiles)")
            rows.append(_probe("cold, second start", model, threads, _env(cold)))
        from verispec import envs

        home = Path(envs.cache_root())
        fresh = root / "new.gguf"
        shutil.copyfile(model, fresh)
        log("startup: a new model file, the kernels built")
        warm_env = _env(home, root / "inductor")
        rows.append(_probe("new file (kernels built)", str(fresh), threads, warm_env))
        log("startup: warm")
        rows.append(_probe("warm", str(fresh), threads, warm_env))
        other = 1 if threads != 1 else 2
        rows.append(_probe(f"warm, num_threads {threads} -> {other}", str(fresh), other, warm_env))
        cli = [sys.executable, "-m", "verispec", "generate", "The capital of France is", "--max-tokens", "32",
               "--model", str(fresh)]
        rows.append(StartupRow("verispec generate, 32 tokens, warm", threads, wall_s=_wall(cli, warm_env)))
        rows.append(StartupRow("verispec serve to /health 200, warm", threads,
                               wall_s=_serve_to_health(warm_env)))
        if (peer := _llama_server(str(fresh), threads)) is not None:
            rows.append(peer)
        if not quick:
            rows += _one_b_rows(model, root, threads, log)
            rows += _gemma3_rows(model, root, threads, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _one_b_rows(model: str, root: Path, threads: int, log: Callable[[str], None]) -> list[StartupRow]:
    """The 1B Q4_K_M benchmark file (benchmarks/model_1b.py) at a path never loaded, with an empty
    Inductor cache: its vocabulary is SmolLM2's, so its tokenizer is found converted; its
    Q4_K / Q6_K layer pattern makes several graphs. Then warm."""
    from benchmarks.model_1b import model_1b
    from verispec import envs

    fresh = root / "new-1b.gguf"
    shutil.copyfile(model_1b("Q4_K_M", model, log=log), fresh)
    env = _env(Path(envs.cache_root()), root / "inductor-1b")
    log("startup: the 1B Q4_K_M file, new")
    rows = [_probe("1B Q4_K_M, new file (kernels built)", str(fresh), threads, env)]
    rows.append(_probe("1B Q4_K_M, warm", str(fresh), threads, env))
    for name, tier in (("exact tier (fp32)", ("float32",)), ("exact tier on the codes", ("float32", "gguf"))):
        exact = root / f"new-1b-{len(tier)}.gguf"  # another new path: the tier's graphs and index from nothing
        shutil.copyfile(fresh, exact)
        log(f"startup: the 1B Q4_K_M file, new, {name}")
        rows.append(_probe(f"1B Q4_K_M, new file, {name}", str(exact), threads,
                           _env(Path(envs.cache_root()), root / f"inductor-1b-{len(tier)}"), tier))
        exact.unlink()
    if (peer := _llama_server(str(fresh), threads)) is not None:
        rows.append(peer)
    return rows


def _gemma3_rows(model: str, root: Path, threads: int, log: Callable[[str], None]) -> list[StartupRow]:
    """A tiny Gemma 3 (benchmarks/model_gemma3.py: sliding and global layers, query/key norms, Q5_0
    and Q6_K matrices) new, then warm."""
    from benchmarks.model_gemma3 import tiny_gemma3
    from verispec import envs

    fresh = root / "new-gemma3.gguf"
    shutil.copyfile(tiny_gemma3(model, log=log), fresh)
    env = _env(Path(envs.cache_root()), root / "inductor-gemma3")
    log("startup: a tiny Gemma 3, new")
    rows = [_probe("tiny Gemma 3 Q4_K_M, new file (kernels built)", str(fresh), threads, env)]
    rows.append(_probe("tiny Gemma 3 Q4_K_M, warm", str(fresh), threads, env))
    if (peer := _llama_server(str(fresh), threads)) is not None:
        rows.append(peer)
    return rows


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def format_startup(rows: list[StartupRow]) -> str:
    lines = ["| scenario | threads | import s | engine s | first token s | 32 tokens s | compiled step s | "
             "kernels built s | command s | engine phases |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.scenario} | {r.threads} | {_fmt(r.import_s)} | {_fmt(r.engine_s)} | "
                     f"{_fmt(r.first_token_s)} | {_fmt(r.tokens_32_s)} | {_fmt(r.compiled_s)} | {_fmt(r.kernels_s)} | "
                     f"{_fmt(r.wall_s)} | "
                     f"{r.phases.removeprefix('engine started in ')} |")
    return "\n".join(lines)


def write_startup(out: Path, machine: dict[str, Any], rows: list[StartupRow]) -> str:
    return write_section(out, "startup", format_startup(rows), {"machine": machine, "rows": [asdict(r) for r in rows]})
