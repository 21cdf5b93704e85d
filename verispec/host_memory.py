"""The C allocator's settings for a process that runs steps: freed memory is kept for the next step.

A CPU step allocates and frees the same few megabytes every time (logits and probabilities are
[rows, vocabulary] float32: 3-6 MB at 16-32 rows of SmolLM2). glibc's malloc serves blocks that
size with fresh mmap'd pages, or trims the top of its heap once more than twice the last freed
block lies free there, so the next step takes those pages back with one page fault per 4 KiB.
Measured on a 2-core VM at 16 rollouts on the fast tier: a verification of 21-32 rows took 5-7 ms
as a rule and 16-28 ms where that happened, and a plain step's median fell from 23.3 to 19.1 ms
with the limits below. So blocks up to glibc's largest mmap threshold come from the heap, and
the heap gives back only what lies free past `TRIM_THRESHOLD` (a process keeps about its largest
step's working set, which it needs again at the next such step).

A user's own `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` (glibc's variables) win, and
another C library (musl, macOS) or an allocator preloaded in malloc's place is left as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): larger is refused.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@cache
def keep_freed_memory() -> bool:
    """Sets the limits once per process; whether they are in force (False: not glibc, or the user
    chose their own)."""
    if not sys.platform.startswith("linux") or any(v in os.environ for v in USER_VARIABLES):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's own symbol: another C library's mallopt differs
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
