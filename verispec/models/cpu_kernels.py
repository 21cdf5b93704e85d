"""verispec's C++ kernels for the CPU, built once per machine with the local C++ compiler.

- Paged attention (`csrc/paged_attention.cpp`). For one decode row SDPA costs 25-80 µs per layer
  on a CPU, mostly fixed overhead, plus the Python that gathers blocks and builds masks; the kernel
  reads the cache blocks in place in a few microseconds, and on long prefill chunks it matches
  SDPA's flash attention. Its results do not depend on how a step is cut.
- The fast tier's packed matmul (`csrc/packed_linear.cpp`): GGUF Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
  Q4_K, Q5_K and Q6_K blocks with the file's bits (`csrc/gguf_pack.cpp` puts a file's rows into
  the layout), activations quantized per block of 32 (int8 with an int8 residual in outlier
  blocks for 4- to 6-bit codes, int16 for 8-bit ones), exact integer dot products, one pass over
  the weights for all of a call's rows; VNNI variants chosen at run time (models/linear.py,
  `PackedLinear`).
- Weight-only quantized matmul for the exact tier on GGUF codes (`csrc/quant_linear.cpp`: 8-bit
  and 4-bit codes decoded exactly to fp32, fp32 activations): fp32 output and the same
  arithmetic for any number of rows.
- RMSNorm in one fixed order of fp32 sums (`csrc/rms_norm.cpp`), the compiled step's norm.

The library is compiled at torch's own CPU dispatch level (`torch.backends.cpu.get_cpu_capability()`,
which `ATEN_CPU_CAPABILITY` can lower) with the flags torch builds that level with, into `kernels/`
under verispec's cache (default `~/.cache/verispec`, verispec/envs.py), keyed by the source,
torch's version, the level, its flags and the compiler, so a machine builds it once (about 75 s on
2 cores: the packed matmul's five variants are most of it). A level whose
build fails falls back to the next one down (AVX512, AVX2, then the portable build); the failure is
remembered beside the library, with the compiler's full output in a log file, and reported in one
line, so a machine does not retry it at every start. No compiler, every build failed, or
the kernels switched off in the environment (verispec/envs.py): attention falls back to SDPA, with
the same results up to rounding.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from verispec import envs
from verispec.models.loader import cache_dir

logger = logging.getLogger("verispec.kernels")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_attention.cpp", "quant_linear.cpp", "packed_linear.cpp", "packed_layout.cpp",
                                       "gguf_pack.cpp", "rms_norm.cpp")]
# Included by the sources: part of the build's key.
_HEADERS = [_CSRC / name for name in ("attention_tiles.h", "packed_activations.h", "packed_layout.h", "packed_linear_body.h",
                                        "packed_tile_qx.h")]
# torch's CPU dispatch levels, best first -> the macro its vector headers read and the flags torch
# compiles that level's kernels with (AVX2's headers convert halves with F16C instructions).
_LEVELS = {
    "AVX512": ("CPU_CAPABILITY_AVX512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]),
    "AVX2": ("CPU_CAPABILITY_AVX2", ["-mavx2", "-mfma", "-mf16c"]),
    "DEFAULT": (None, []),  # portable: the headers' scalar-loop vectors, any x86-64 (or other) CPU
}


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """What `cpu_kernels_available()` settled on: the level it loaded (None: no kernels) and why."""

    level: str | None
    reason: str = ""  # why not torch's own level, or why none; empty when all is as wanted

    def describe(self) -> str:
        """For the start-up line and the metrics label: the level, and the packed matmul's
        variant on this CPU (e.g. `verispec AVX512 (packed avx512_vnni)`)."""
        if not self.level:
            return f"off ({self.reason})"
        return f"verispec {self.level} (packed {torch.ops.verispec_cpu.packed_variants()[0]})"


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile and verispec's kernels use: $CXX, else g++, else clang++."""
    return next((shutil.which(cc) for cc in (os.environ.get("CXX"), "g++", "clang++") if cc and shutil.which(cc)), None)


def build_levels(capability: str | None = None) -> list[str]:
    """torch's level (this process's dispatch), then every level below it."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    order = list(_LEVELS)
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


def _compile_command(cxx: str, source: Path, obj: Path, level: str) -> list[str]:
    macro, flags = _LEVELS[level]
    cmd = [cxx, "-c", str(source), "-o", str(obj), "-fPIC", "-O3", "-std=c++17", "-fopenmp",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *flags, *vnni_defines()]
    if macro:
        cmd.append(f"-D{macro}")
    return cmd + [f"-I{p}" for p in cpp_extension.include_paths()]


def _link_command(cxx: str, objs: list[Path], target: Path) -> list[str]:
    cmd = [cxx, *map(str, objs), "-o", str(target), "-shared", "-fopenmp"]
    for lib_dir in cpp_extension.library_paths():
        cmd += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    return cmd + ["-lc10", "-ltorch", "-ltorch_cpu"]


def _run_all(commands: list[list[str]]) -> tuple[bool, str]:
    """Runs the commands at once (one source per core: most of the time goes to parsing ATen's
    headers); whether all succeeded, and their output."""
    procs, output, ok = [], [], True
    for cmd in commands:
        try:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        except OSError as exc:
            ok = False
            output.append(f"{cmd[0]}: {exc}")
    for proc in procs:
        out, _ = proc.communicate()
        ok = ok and proc.returncode == 0
        output.append(out)
    return ok, "".join(output)


def _key(cxx: str, level: str) -> str:
    stat = os.stat(cxx)  # another compiler (or an upgraded one) gets another try
    parts = [p.read_bytes() for p in _SOURCES + _HEADERS] + [
        torch.__version__.encode(), repr((_LEVELS[level], vnni_defines())).encode(), sys.version.encode(),
        f"{cxx}:{stat.st_mtime_ns}".encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


class BuildFailed(RuntimeError):
    def __init__(self, what: str, cause: str, log: Path):
        super().__init__(f"the {what} build failed ({cause}); compiler output in {log}")


def _first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln), lines[-1] if lines else "no output")[:160]


def build_once(stem: str, what: str, cxx: str, compile_into) -> Path:
    """`kernels/<stem>.so` under verispec's cache, made by `compile_into(path)` (which returns
    whether it succeeded and the compiler's output) on first use. Raises `BuildFailed`, also for a
    failure remembered from an earlier start: delete the .failed file, or change the compiler, to
    retry."""
    cache = cache_dir() / "kernels"
    target, failed, log = cache / f"{stem}.so", cache / f"{stem}.failed", cache / f"{stem}.log"
    if target.exists():
        return target
    if failed.exists():
        raise BuildFailed(what, failed.read_text().strip() or "an earlier start", log)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        ok, output = compile_into(built)
        if not ok or not built.exists():
            log.write_text(output)
            cause = f"{Path(cxx).name}: {_first_error(output)}"
            failed.write_text(cause + "\n")
            raise BuildFailed(what, cause, log)
        os.replace(built, target)  # atomic: a concurrent builder never loads half a file
    return target


def build(cxx: str, level: str) -> Path:
    """The library for `level`, compiled on first use (`build_once`)."""

    def compile_into(built: Path) -> tuple[bool, str]:
        logger.info("building verispec's CPU kernels for %s (once per machine, about 2 minutes on 2 cores)", level)
        objs = [built.parent / f"{src.stem}.o" for src in _SOURCES]
        ok, output = _run_all([_compile_command(cxx, src, obj, level) for src, obj in zip(_SOURCES, objs)])
        if ok:
            ok, linked = _run_all([_link_command(cxx, objs, built)])
            output += linked
        return ok, output

    return build_once(f"verispec_cpu-{level.lower()}-{_key(cxx, level)}", level, cxx, compile_into)


_build_lock = threading.Lock()  # the engine starts the build in a thread; a model that needs it waits


def kernel_build() -> KernelBuild:
    """Builds and loads the best level that builds, once per process."""
    with _build_lock:
        return _kernel_build()


@functools.cache
def _kernel_build() -> KernelBuild:
    if not envs.cpu_kernels_enabled():
        return KernelBuild(None, f"{envs.CPU_KERNELS}=0")
    cxx = cxx_compiler()
    if cxx is None:
        return KernelBuild(None, "no C++ compiler; install g++")
    chosen = load_best(cxx, build_levels(), torch.ops.load_library)
    if chosen.level is None:
        logger.warning("verispec's CPU kernels are unavailable; attention runs on SDPA and 8-bit matrices on "
                       "int4 planes (slower): %s", chosen.reason)
    else:
        _register_fakes()
        if chosen.reason:
            logger.warning("verispec's CPU kernels run at %s: %s", chosen.level, chosen.reason)
    return chosen


def load_best(cxx: str, levels: list[str], load) -> KernelBuild:
    """The first of `levels` that builds and loads (`load(path)`), with the failures above it."""
    failures = []
    for level in levels:
        try:
            path = build(cxx, level)
        except BuildFailed as exc:
            failures.append(str(exc))
            continue
        try:
            load(str(path))
        except Exception as exc:  # noqa: BLE001 - a library that does not load: the next level down
            failures.append(f"the {level} build does not load ({str(exc)[:160]})")
            continue
        return KernelBuild(level, "; ".join(failures))
    return KernelBuild(None, "; ".join(failures))


kernel_build.cache_clear = _kernel_build.cache_clear  # for tests that switch the kernels off and on


def cpu_kernels_available() -> bool:
    """Whether `torch.ops.verispec_cpu` (paged_attention, packed_linear, int8_linear, int4_linear, dense_linear,
    rms_norm) is loaded."""
    return kernel_build().level is not None


def kernels_wanted() -> bool:
    """Whether this machine should have the kernels: a C++ compiler, and not switched off."""
    return envs.cpu_kernels_enabled() and cxx_compiler() is not None


_fakes_registered = False


def _register_fakes() -> None:
    """Shapes for torch.compile: the matmuls and norms sit inside the compiled layer stack."""
    global _fakes_registered
    if not _fakes_registered:
        for name in ("int8_linear", "int4_linear"):
            torch.library.register_fake(f"verispec_cpu::{name}")(_matmul_shape)
        torch.library.register_fake("verispec_cpu::packed_linear")(_packed_shape)
        torch.library.register_fake("verispec_cpu::dense_linear")(
            lambda x, weights, n: x.new_empty((x.shape[0], n), dtype=torch.float32))
        torch.library.register_fake("verispec_cpu::rms_norm")(lambda x, weight, eps: x.new_empty(x.shape))
        torch.library.register_fake("verispec_cpu::packed_rows")(
            lambda ids, codes, scales, offsets, format, n, dtype: codes.new_empty(
                (ids.numel(), codes.shape[1] * 32), dtype=dtype))
        _fakes_registered = True


def _matmul_shape(x, codes, scales, *rest):
    return x.new_empty((x.shape[0], rest[-1]), dtype=torch.float32)


def _packed_shape(x, codes, scales, offsets, format, n, variant=""):
    return x.new_empty((x.shape[0], n))
