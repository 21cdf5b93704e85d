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

The library is built once per machine (`kernel_compiler.py`: torch's own CPU dispatch level,
`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY` can lower, with the flags torch
builds that level with; a level whose build fails falls back to the next one down, AVX512, AVX2,
then the portable build). An engine does not wait for a first build: it starts the build in a
background process and runs on torch's kernels until its next start (`kernel_build(wait=False)`);
tests and benchmarks wait for the build. No compiler, every build failed, or the kernels switched
off in the environment (verispec/envs.py): attention falls back to SDPA and the fast tier's
matrices to torch's int4 kernel, with the same results up to rounding.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from verispec import envs
from verispec.cores import govern_threads
from verispec.models.kernel_compiler import (BACKGROUND_BUILD_TIME, BuildFailed, build, build_in_background,
                                              build_levels, built, cxx_compiler, stem)

logger = logging.getLogger("verispec.kernels")


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """What `cpu_kernels_available()` settled on: the level it loaded (None: no kernels) and why."""

    level: str | None
    reason: str = ""  # why not torch's own level, or why none; empty when all is as wanted
    building: bool = False  # not built yet: a background process builds them for the next start
    library: str = ""  # the loaded library's file name (its sources' hash in it)

    def describe(self) -> str:
        """For the start-up line and the metrics label: the level, and the packed matmul's
        variant on this CPU (e.g. `verispec AVX512 (packed avx512_vnni)`)."""
        if not self.level:
            return f"off ({self.reason})"
        return f"verispec {self.level} (packed {packed_variant()})"


def packed_variant() -> str:
    """The packed matmul's instruction-set variant: the one the environment names (envs.py's
    PACKED_VARIANT, for comparisons; an error names the ones this build runs here), else the best
    this CPU runs."""
    runs = torch.ops.verispec_cpu.packed_variants()
    asked = envs.packed_variant()
    if asked and asked not in runs:
        raise ValueError(f"{envs.PACKED_VARIANT}={asked!r}: this CPU runs {', '.join(runs)}")
    return asked or runs[0]


_build_lock = threading.Lock()  # the engine asks from a start-up thread; a model that needs them waits
_chosen: KernelBuild | None = None


def kernel_build(wait: bool = True) -> KernelBuild:
    """The kernels this process runs on, decided by its first call and kept: the best level that
    builds and loads. Without `wait`, a library not built yet is built by a background process
    for the next start, and this process runs without (an engine's first answer does not wait
    minutes for a compiler)."""
    global _chosen
    with _build_lock:
        if _chosen is None:
            _chosen = _decide(wait)
        return _chosen


def _decide(wait: bool) -> KernelBuild:
    if not envs.cpu_kernels_enabled():
        return KernelBuild(None, f"{envs.CPU_KERNELS}=0")
    cxx = cxx_compiler()
    if cxx is None:
        return KernelBuild(None, "no C++ compiler; install g++")
    chosen = load_best(cxx, build_levels(), torch.ops.load_library, wait)
    if chosen.building:
        logger.info("building verispec's CPU kernels in the background (once per machine, %s, at low priority); "
                    "until the next start, attention runs on SDPA and the matrices on torch's kernels",
                    BACKGROUND_BUILD_TIME)
    elif chosen.level is None:
        logger.warning("verispec's CPU kernels are unavailable; attention runs on SDPA and 8-bit matrices on "
                       "int4 planes (slower): %s", chosen.reason)
    else:
        _register_fakes()
        if chosen.reason:
            logger.warning("verispec's CPU kernels run at %s: %s", chosen.level, chosen.reason)
    return chosen


def load_best(cxx: str, levels: list[str], load, wait: bool = True) -> KernelBuild:
    """The first of `levels` that builds and loads (`load(path)`), with the failures above it.
    Without `wait`, the first level not built yet starts a background build and ends the search."""
    global _share
    failures = []
    for i, level in enumerate(levels):
        try:
            path = build(cxx, level) if wait else built(stem(cxx, level), level)
        except BuildFailed as exc:
            failures.append(str(exc))
            continue
        if path is None:
            _share = _CoreShare(build_in_background(cxx, levels[i:]))
            return KernelBuild(None, "building in the background", building=True)
        try:
            load(str(path))
        except Exception as exc:  # noqa: BLE001 - a library that does not load: the next level down
            failures.append(f"the {level} build does not load ({str(exc)[:160]})")
            continue
        return KernelBuild(level, "; ".join(failures), library=path.name)
    return KernelBuild(None, "; ".join(failures))


class _CoreShare:
    """The cores an engine shares with a background build, while it runs."""

    def __init__(self, wait_for_build: Callable[[], object]):
        self.ended = threading.Event()
        threading.Thread(target=lambda: (wait_for_build(), self.ended.set()), daemon=True,
                         name="verispec-kernel-build").start()


_share: _CoreShare | None = None


def share_cores(start: bool = False) -> None:
    """Called on the thread that runs an engine's ops, as it starts (`start`) and before each step:
    that thread's thread count for the next step (verispec/cores.py). While a background build
    runs, one thread fewer (at least one), the build on the core left (one source at a time); the
    full count once the build ends. On a 2-core VM an engine's two threads beside one compiler
    started and answered 5-10x slower (each parallel region waits for its descheduled thread),
    one thread beside it at about its quiet speed. Other busy processes take cores likewise."""
    share = _share
    govern_threads(build_running=share is not None and not share.ended.is_set(), start=start)


def _forget() -> None:
    """For tests that switch the kernels off and on: the next call decides again."""
    global _chosen, _share
    _chosen = _share = None


kernel_build.cache_clear = _forget


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
