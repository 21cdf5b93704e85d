"""verispec's C++ kernels for the CPU, built once per machine with the local C++ compiler.

- Paged attention (`csrc/paged_attention.cpp`). For one decode row SDPA costs 25-80 µs per layer
  on a CPU, mostly fixed overhead, plus the Python that gathers blocks and builds masks; the kernel
  reads the cache blocks in place in a few microseconds, and on long prefill chunks it matches
  SDPA's flash attention. Its results do not depend on how a step is cut.
- Weight-only quantized matmul (`csrc/quant_linear.cpp`: 8-bit and 4-bit codes decoded exactly
  to fp32), for the Q8_0 lm_head in every CPU tier and for every matrix of the exact tier on GGUF
  codes: 1.0 ms for one row of SmolLM2's 49152 x 576 head and 5.3 ms for 16, against 1.6 and
  11.8 ms on two int4 planes, with fp32 output and the same arithmetic for any number of rows.

The library is compiled for this CPU's vector ISA (torch's own dispatch level) into
`kernels/` under verispec's cache (`$VERISPEC_CACHE`, default `~/.cache/verispec`), keyed by the
source, torch's version and the ISA, so a machine builds it once (about 10 s). No compiler, a failed build or
`VERISPEC_CPU_KERNELS=0`: attention falls back to SDPA, with the same results up to rounding.
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
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from verispec.models.loader import cache_dir

logger = logging.getLogger("verispec.kernels")

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention.cpp", "quant_linear.cpp")]
# torch's CPU dispatch level -> the macro its vector headers read and the compiler flags it needs.
_ISA = {
    "AVX512": ("CPU_CAPABILITY_AVX512", ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]),
    "AVX2": ("CPU_CAPABILITY_AVX2", ["-mavx2", "-mfma"]),
}


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile and verispec's kernels use: $CXX, else g++, else clang++."""
    return next((shutil.which(cc) for cc in (os.environ.get("CXX"), "g++", "clang++") if cc and shutil.which(cc)), None)


def _command(cxx: str, target: Path) -> list[str]:
    macro, flags = _ISA.get(torch.backends.cpu.get_cpu_capability(), (None, []))
    cmd = [cxx, *map(str, _SOURCES), "-o", str(target), "-shared", "-fPIC", "-O3", "-std=c++17", "-fopenmp",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *flags]
    if macro:
        cmd.append(f"-D{macro}")
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    for lib_dir in cpp_extension.library_paths():
        cmd += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    return cmd + ["-lc10", "-ltorch", "-ltorch_cpu"]


def _build() -> Path:
    cxx = cxx_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++)")
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in _SOURCES) + torch.__version__.encode() + torch.backends.cpu.get_cpu_capability().encode()
        + sys.version.encode()
    ).hexdigest()[:16]
    cache = cache_dir() / "kernels"
    target = cache / f"verispec_cpu-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        logger.info("building verispec's CPU kernels (once per machine, about 15 s)")
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(_command(cxx, built), capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{cxx} failed: {result.stderr[-2000:]}")
            os.replace(built, target)  # atomic: a concurrent builder never loads half a file
    return target


@functools.cache
def cpu_kernels_available() -> bool:
    """Whether `torch.ops.verispec_cpu` (paged_attention, int8_linear) is loaded, building it on first use."""
    if os.environ.get("VERISPEC_CPU_KERNELS", "1") == "0":
        return False
    try:
        torch.ops.load_library(str(_build()))
        _register_fakes()
    except Exception as exc:  # noqa: BLE001 - any failure means: use SDPA
        logger.warning("verispec's CPU kernels are unavailable; attention runs on SDPA and 8-bit matrices on "
                       "int4 planes (slower): %s", exc)
        return False
    return True


_fakes_registered = False


def _register_fakes() -> None:
    """Shapes for torch.compile: the matmuls sit inside the compiled layer stack."""
    global _fakes_registered
    if not _fakes_registered:
        for name in ("int8_linear", "int4_linear"):
            torch.library.register_fake(f"verispec_cpu::{name}")(_matmul_shape)
        _fakes_registered = True


def _matmul_shape(x, codes, scales, *rest):
    return x.new_empty((x.shape[0], rest[-1]), dtype=torch.float32)
