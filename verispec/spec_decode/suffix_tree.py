"""The suffix tree of suffix decoding (`csrc/suffix_tree.cpp`), built once per machine.

Why C++: the tree moves every growing suffix of a sequence by one node per appended token, up to
`suffix_decoding_max_tree_depth` of them (24 by default), in the per-request tree and the global
one. In Python that loop measured 77 us per token and tree on this project's 2-core VM, about 7 ms
a step at batch 16 with three tokens per request: far over the drafter's 5 % share of a step.
The extension does it in well under a microsecond.

The module is portable C++ (no vector instructions): one build serves every CPU level. It is
compiled with the local C++ compiler against Python's headers and the pybind11 headers torch
ships, into `kernels/` under verispec's cache, keyed by the source, the compiler and Python's
version (a few seconds, once). A failed build is remembered beside it with the compiler's output.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import torch.utils.cpp_extension as cpp_extension

from verispec.models.kernel_compiler import BuildFailed, build_once, cxx_compiler

_SOURCE = Path(__file__).parent / "csrc" / "suffix_tree.cpp"
_MODULE = "verispec_suffix"


class SuffixTreeUnavailable(RuntimeError):
    """The extension cannot be built here (no compiler, no Python headers, or a failed build)."""


def _key(cxx: str) -> str:
    stat = os.stat(cxx)
    parts = [_SOURCE.read_bytes(), sys.version.encode(), f"{cxx}:{stat.st_mtime_ns}".encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build(cxx: str) -> Path:
    includes = [sysconfig.get_paths()["include"], *cpp_extension.include_paths()]

    def compile_into(built: Path) -> tuple[bool, str]:
        cmd = [cxx, str(_SOURCE), "-o", str(built), "-shared", "-fPIC", "-O2", "-std=c++17",
               "-fvisibility=hidden", *(f"-I{p}" for p in includes)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return proc.returncode == 0, proc.stdout

    try:
        return build_once(f"{_MODULE}-{_key(cxx)}", "suffix tree", cxx, compile_into)
    except BuildFailed as exc:
        raise SuffixTreeUnavailable(str(exc)) from None


_lock = threading.Lock()


@functools.cache
def _load():
    cxx = cxx_compiler()
    if cxx is None:
        raise SuffixTreeUnavailable("no C++ compiler (install g++)")
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        raise SuffixTreeUnavailable("no Python headers (install python3-dev)")
    path = _build(cxx)
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def suffix_tree_module():
    """The loaded extension (`SuffixTree`, `Draft`); raises SuffixTreeUnavailable naming the cause."""
    with _lock:
        return _load()


def SuffixTree(depth: int):  # noqa: N802 - a constructor, named as the class it returns
    """A new tree whose suffixes are `depth` tokens deep at most."""
    return suffix_tree_module().SuffixTree(depth)
