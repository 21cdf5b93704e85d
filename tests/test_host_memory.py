"""host_memory: a CPU step's freed blocks stay with the process, so the next step does not fault them back
in page by page; a user's own glibc variables and other C libraries are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from verispec import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = sys.platform.startswith("linux") and "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {}) \
    and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")

# A step's shape: probabilities over SmolLM2's vocabulary for 32 rows (6 MB per tensor), freed each time.
STEP_LOOP = textwrap.dedent("""
    import resource, sys
    import torch
    from verispec.host_memory import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "kept" else None
    torch.set_num_threads(1)
    logits = torch.randn(32, 49152)
    def step():
        probs = torch.softmax(logits, -1)
        return (probs * 2).cumsum(-1)[0, 0]
    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        step()
    print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 100)
""")


def run_steps(mode: str, **env: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", STEP_LOOP, mode], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, check=True, timeout=120).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not GLIBC, reason="the limits are glibc malloc's; another C library keeps its own policy")
def test_freed_step_memory_is_not_faulted_back_in():
    kept, faults = run_steps("kept")
    assert kept == "True"
    # Each 6 MB tensor taken from fresh pages would cost 1536 faults; kept memory costs none.
    assert faults < 16


@pytest.mark.skipif(not GLIBC, reason="the variables are glibc's")
def test_a_users_own_malloc_variables_win():
    kept, _ = run_steps("kept", MALLOC_TRIM_THRESHOLD_="131072")
    assert kept == "False"


def test_other_platforms_are_left_alone(monkeypatch):
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()
