"""Building verispec's C++ libraries for this CPU with the local compiler, once per machine.

The CPU kernels (`cpu_kernels.py` loads them) are compiled at torch's own CPU dispatch level with
the flags torch builds that level with, into `kernels/` under verispec's cache (verispec/envs.py),
keyed by the sources, torch's version, the level, its flags and the compiler. A build takes
minutes on a small machine, so an engine never waits for it: `build_in_background` starts this
module as a process of its own (`python -m verispec.models.kernel_compiler`), at the lowest
priority and in a session of its own, so it finishes even when the command that started it
(`verispec generate`) has answered and exited; the next start loads the library. A lock file beside
the libraries keeps one build at a time: a foreground `build` waits for a background one.

A level whose build fails is remembered beside the library (the compiler's full output in a log
file), so a machine does not retry it at every start: delete the .failed file, or change the
compiler, to retry.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from verispec import envs

logger = logging.getLogger("verispec.kernels")

_CSRC = Path(__file__).parent / "csrc"
# Longest first: a build runs one per core. The packed matmul's tiles are one source per
# instruction set (a variant the level does not have compiles to nothing).
_SOURCES = [_CSRC / name for name in (
    "packed_tiles_avx512.cpp", "packed_tiles_avx2.cpp", "packed_tiles_portable.cpp", "paged_attention.cpp",
    "quant_linear.cpp", "packed_linear.cpp", "packed_layout.cpp", "gguf_pack.cpp", "rms_norm.cpp")]
# Included by the sources: part of the build's key.
_HEADERS = [_CSRC / name for name in ("attention_tiles.h", "packed_activations.h", "packed_layout.h",
                                        "packed_linear_body.h", "packed_tile_qx.h", "packed_tiles.h")]
# torch's CPU dispatch levels, best first -> the macro its vector headers read and the flags torch
# compiles that level's kernels with (AVX2's headers convert halves with F16C instructions).
LEVELS = {
    "AVX512": ("CPU_CAPABILITY_AVX512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]),
    "AVX2": ("CPU_CAPABILITY_AVX2", ["-mavx2", "-mfma", "-mf16c"]),
    "DEFAULT": (None, []),  # portable: the headers' scalar-loop vectors, any x86-64 (or other) CPU
}
# What a first build costs on 2 cores, for the line that announces it: alone, and one source at a
# time beside an engine.
BUILD_TIME = "about a minute on 2 cores"
BACKGROUND_BUILD_TIME = "about 2 minutes on 2 cores"


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile and verispec's kernels use: $CXX, else g++, else clang++."""
    return next((shutil.which(cc) for cc in (os.environ.get("CXX"), "g++", "clang++") if cc and shutil.which(cc)), None)


def build_levels(capability: str | None = None) -> list[str]:
    """torch's level (this process's dispatch), then every level below it."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    order = list(LEVELS)
    return order[order.index(capability):] if capability in order else ["DEFAULT"]


@functools.cache
def vnni_defines() -> tuple[str, ...]:
    """The packed matmul's VNNI variants this CPU runs (its flags as the kernel reads them from
    CPUID, through the OS's /proc/cpuinfo); a variant no CPU here runs is not compiled."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return tuple(d for flag, d in (("avx_vnni", "-DVS_BUILD_AVXVNNI"), ("avx512_vnni", "-DVS_BUILD_AVX512VNNI"))
                 if flag in flags)


def _optimization(source: Path, level: str) -> str:
    """-O3, but -O2 for the portable tiles where they are only the vector variants' reference
    (-O3 unrolls their 16-lane loops for 150 s; they give the same bits, as tests check)."""
    return "-O2" if source.name == "packed_tiles_portable.cpp" and level != "DEFAULT" else "-O3"


def _compile_command(cxx: str, source: Path, obj: Path, level: str) -> list[str]:
    macro, flags = LEVELS[level]
    cmd = [cxx, "-c", str(source), "-o", str(obj), "-fPIC", _optimization(source, level), "-std=c++17", "-fopenmp",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *flags, *vnni_defines()]
    if macro:
        cmd.append(f"-D{macro}")
    import torch.utils.cpp_extension as cpp_extension  # 0.2 s (it imports setuptools): only to build

    return cmd + [f"-I{p}" for p in cpp_extension.include_paths()]


def _link_command(cxx: str, objs: list[Path], target: Path) -> list[str]:
    import torch.utils.cpp_extension as cpp_extension

    cmd = [cxx, *map(str, objs), "-o", str(target), "-shared", "-fopenmp"]
    for lib_dir in cpp_extension.library_paths():
        cmd += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    return cmd + ["-lc10", "-ltorch", "-ltorch_cpu"]


def _run_all(commands: list[list[str]], jobs: int | None = None) -> tuple[bool, str]:
    """Runs the commands `jobs` at a time (default one per core), in the list's order (longest
    first); whether all succeeded, and their output in the list's order."""
    def one(cmd: list[str]) -> tuple[bool, str]:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as exc:
            return False, f"{cmd[0]}: {exc}"
        return proc.returncode == 0, proc.stdout

    with ThreadPoolExecutor(jobs or max(1, len(os.sched_getaffinity(0)))) as pool:
        results = list(pool.map(one, commands))
    return all(ok for ok, _ in results), "".join(out for _, out in results)


def _key(cxx: str, level: str) -> str:
    stat = os.stat(cxx)  # another compiler (or an upgraded one) gets another try
    parts = [p.read_bytes() for p in _SOURCES + _HEADERS] + [
        torch.__version__.encode(), repr((LEVELS[level], vnni_defines())).encode(), sys.version.encode(),
        f"{cxx}:{stat.st_mtime_ns}".encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


class BuildFailed(RuntimeError):
    def __init__(self, what: str, cause: str, log: Path):
        super().__init__(f"the {what} build failed ({cause}); compiler output in {log}")


def _first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln), lines[-1] if lines else "no output")[:160]


def _paths(stem: str) -> tuple[Path, Path, Path]:
    cache = Path(envs.cache_root()) / "kernels"
    return cache / f"{stem}.so", cache / f"{stem}.failed", cache / f"{stem}.log"


def built(stem: str, what: str) -> Path | None:
    """`kernels/<stem>.so` if it is built, None if not yet; raises `BuildFailed` for a failure
    remembered from an earlier build."""
    target, failed, log = _paths(stem)
    if target.exists():
        return target
    if failed.exists():
        raise BuildFailed(what, failed.read_text().strip() or "an earlier start", log)
    return None


def build_once(stem: str, what: str, cxx: str, compile_into) -> Path:
    """`kernels/<stem>.so` under verispec's cache, made by `compile_into(path)` (which returns
    whether it succeeded and the compiler's output) on first use. Raises `BuildFailed`, also for a
    failure remembered from an earlier start."""
    target = built(stem, what)
    if target is not None:
        return target
    target, failed, log = _paths(stem)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        made = Path(tmp) / target.name
        ok, output = compile_into(made)
        if not ok or not made.exists():
            log.write_text(output)
            cause = f"{Path(cxx).name}: {_first_error(output)}"
            failed.write_text(cause + "\n")
            raise BuildFailed(what, cause, log)
        os.replace(made, target)  # atomic: a concurrent loader never sees half a file
    return target


def stem(cxx: str, level: str) -> str:
    return f"verispec_cpu-{level.lower()}-{_key(cxx, level)}"


def _build_unlocked(cxx: str, level: str, jobs: int | None = None) -> Path:
    def compile_into(made: Path) -> tuple[bool, str]:
        objs = [made.parent / f"{src.stem}.o" for src in _SOURCES]
        ok, output = _run_all([_compile_command(cxx, src, obj, level) for src, obj in zip(_SOURCES, objs)], jobs)
        if ok:
            ok, linked = _run_all([_link_command(cxx, objs, made)])
            output += linked
        return ok, output

    return build_once(stem(cxx, level), level, cxx, compile_into)


def _lock_path() -> Path:
    path = Path(envs.cache_root()) / "kernels" / "build.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _build_lock(wait: bool):
    """The machine's one kernel build at a time, held by the process that builds (its pid in the
    file, for whoever waits): yields whether this process holds it (without `wait`, False when
    another process builds)."""
    with open(_lock_path(), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            fh.seek(0)
            logger.info("waiting for verispec's CPU kernels, which another process (pid %s) is building",
                        fh.read().strip() or "?")
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.truncate(0)  # a+ appends: after the truncation the file holds the pid alone
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _building() -> bool:
    """Whether a process builds now. A shared probe: it writes nothing and waits for nothing."""
    with open(_lock_path(), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def _wait_for_build() -> None:
    with open(_lock_path(), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)  # granted once the builder lets go; released as the file closes


def build(cxx: str, level: str) -> Path:
    """The library for `level`, compiled here and now on first use, or waited for where a background
    build is making it. Raises `BuildFailed`."""
    name = stem(cxx, level)
    if (path := built(name, level)) is not None:
        return path
    with _build_lock(wait=True):
        if built(name, level) is None:
            logger.info("building verispec's CPU kernels for %s (once per machine, %s)", level, BUILD_TIME)
        return _build_unlocked(cxx, level)


def building_pid() -> int | None:
    """The process that builds the kernels now, if one does."""
    if not _building():
        return None
    try:
        return int(_lock_path().read_text().strip())
    except (OSError, ValueError):
        return None


def build_in_background(cxx: str, levels: list[str]) -> Callable[[], object]:
    """Starts a process that builds the first of `levels` that builds, unless one is building;
    returns a function that waits until the build has ended."""
    if _building():
        return _wait_for_build
    proc = subprocess.Popen([sys.executable, "-m", __name__, "--cxx", cxx, *levels], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
    return proc.wait


def main(argv: list[str] | None = None) -> int:
    """The background build: the levels best first, until one builds; one source at a time, at the
    lowest priority there is (SCHED_IDLE, inherited by the compiler), on the core the engine leaves
    it (cpu_kernels.share_cores)."""
    parser = argparse.ArgumentParser(prog="python -m verispec.models.kernel_compiler")
    parser.add_argument("--cxx", required=True)
    parser.add_argument("levels", nargs="+", choices=list(LEVELS))
    args = parser.parse_args(argv)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the lowest priority there is
        os.nice(19)
    with _build_lock(wait=False) as free:
        if not free:
            return 0  # another process builds them
        for level in args.levels:
            try:
                _build_unlocked(args.cxx, level, jobs=1)
                return 0
            except BuildFailed:
                continue
    return 1


if __name__ == "__main__":
    sys.exit(main())
