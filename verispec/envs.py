"""Every environment variable verispec reads, read here and nowhere else (docs/design.md has the
table). Each is read when asked for, so a test or a parent process may set it late.

| variable | default | effect |
|---|---|---|
| `VERISPEC_CACHE` | `$XDG_CACHE_HOME/verispec`, else `~/.cache/verispec` | the on-disk cache: built kernels, tokenizers read from GGUF files |
| `VERISPEC_CPU_KERNELS` | `1` | `0`: verispec's CPU kernels are not built; attention runs on SDPA, packed matrices on torch's int4 kernel |
| `VERISPEC_PACKED_KERNEL` | `1` | `0`: the fast tier's matrices run on torch's int4 kernel, not the packed one (comparisons) |
| `VERISPEC_PACKED_VARIANT` | unset | the packed kernel's instruction set (`avx512_vnni`, `avx512`, `avx2_vnni`, `avx2`, `portable`; one this CPU runs): comparisons; unset, the best one |
| `VERISPEC_COMPILE` | `1` | `0`: `enforce_eager` defaults to true (no torch.compile); an engine's own setting still wins when true |
| `VERISPEC_ADAPTIVE_THREADS` | `1` | `0`: an engine keeps its full thread count beside busy processes (verispec/cores.py) |
| `VERISPEC_API_KEY` | unset | `verispec serve --api-key`'s default |
| `VERISPEC_LLAMA_CPP` | unset | the benchmark's llama.cpp tools (their build's `bin/`; `python -m benchmarks.build_llama_cpp`) |
"""

from __future__ import annotations

import os

# The variables' names, for messages and for tests that set them.
CACHE = "VERISPEC_CACHE"
CPU_KERNELS = "VERISPEC_CPU_KERNELS"
PACKED_KERNEL = "VERISPEC_PACKED_KERNEL"
PACKED_VARIANT = "VERISPEC_PACKED_VARIANT"
COMPILE = "VERISPEC_COMPILE"
ADAPTIVE_THREADS = "VERISPEC_ADAPTIVE_THREADS"
API_KEY = "VERISPEC_API_KEY"
LLAMA_CPP = "VERISPEC_LLAMA_CPP"


def _on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def cache_root() -> str:
    return os.environ.get(CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "verispec")


def cpu_kernels_enabled() -> bool:
    return _on(CPU_KERNELS)


def packed_kernel_enabled() -> bool:
    return _on(PACKED_KERNEL)


def packed_variant() -> str:
    """The packed kernel's variant asked for, or "" (the best this CPU runs)."""
    return os.environ.get(PACKED_VARIANT, "")


def compile_enabled() -> bool:
    return _on(COMPILE)


def adaptive_threads() -> bool:
    return _on(ADAPTIVE_THREADS)


def api_key() -> str | None:
    return os.environ.get(API_KEY)


def llama_cpp_bin() -> str | None:
    return os.environ.get(LLAMA_CPP) or None
