"""Building the CPU kernels: each level's flags, and the background build an engine starts instead of
waiting (it outlives its starter, runs at the lowest priority, and a foreground build waits for it
rather than building twice)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from verispec.models import kernel_compiler


def fake_compiler(tmp_path, seconds: float):
    """A compiler that takes `seconds` per call and writes an empty output file; it logs its calls."""
    calls, fake = tmp_path / "calls", tmp_path / "fake-g++"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" >> {calls}\n"
                    f"sleep {seconds}\n"
                    'while [ "$1" != "-o" ]; do shift; done; : > "$2"\n')
    fake.chmod(0o755)
    return str(fake), calls


def wait_for_builder(timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while (pid := kernel_compiler.building_pid()) is None:
        assert time.monotonic() < deadline, "no background build started"
        time.sleep(0.1)
    return pid


def test_every_level_has_flags_and_the_portable_build_has_none():
    assert kernel_compiler.build_levels("AVX512") == ["AVX512", "AVX2", "DEFAULT"]
    assert kernel_compiler.build_levels("AVX2") == ["AVX2", "DEFAULT"]
    assert kernel_compiler.build_levels("SVE256") == ["DEFAULT"]  # another architecture: portable only
    src, obj = kernel_compiler._SOURCES[0], kernel_compiler.Path("x.o")
    avx2 = kernel_compiler._compile_command("g++", src, obj, "AVX2")
    assert {"-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"} <= set(avx2)
    portable = kernel_compiler._compile_command("g++", src, obj, "DEFAULT")
    assert not [a for a in portable if a.startswith("-m") or "CPU_CAPABILITY" in a]


def test_a_background_build_runs_apart_and_a_foreground_build_waits_for_it(monkeypatch, tmp_path):
    fake, calls = fake_compiler(tmp_path, 1.5)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    stem = kernel_compiler.stem(fake, "AVX2")
    started = time.monotonic()
    kernel_compiler.build_in_background(fake, ["AVX2", "DEFAULT"])
    assert time.monotonic() - started < 1.0  # it returns at once
    pid = wait_for_builder()
    assert pid != os.getpid()
    assert os.sched_getscheduler(pid) == os.SCHED_IDLE  # only cores nothing else wants
    assert os.getsid(pid) != os.getsid(0)  # a session of its own: the starter's exit or ^C leaves it running
    kernel_compiler.build_in_background(fake, ["AVX2", "DEFAULT"])  # one build at a time
    assert kernel_compiler.built(stem, "AVX2") is None
    path = kernel_compiler.build(fake, "AVX2")  # waits for the background build, builds nothing itself
    assert path.exists() and kernel_compiler.building_pid() is None
    assert len(calls.read_text().splitlines()) == len(kernel_compiler._SOURCES) + 1  # each source once, one link


def test_a_background_build_that_fails_is_remembered_and_the_next_level_is_built(monkeypatch, tmp_path):
    fake, calls = fake_compiler(tmp_path, 0)
    fake_failing = tmp_path / "fails-avx512"
    fake_failing.write_text(f"#!/bin/sh\ncase \"$*\" in *-mavx512f*) echo 'error: no AVX-512' >&2; exit 1;; esac\n"
                            f"exec {fake} \"$@\"\n")
    fake_failing.chmod(0o755)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "verispec.models.kernel_compiler", "--cxx", str(fake_failing),
                          "AVX512", "AVX2"], env=dict(os.environ, VERISPEC_CACHE=str(tmp_path / "cache")), timeout=120)
    assert run.returncode == 0
    assert kernel_compiler.built(kernel_compiler.stem(str(fake_failing), "AVX2"), "AVX2") is not None
    try:
        kernel_compiler.built(kernel_compiler.stem(str(fake_failing), "AVX512"), "AVX512")
        raise AssertionError("the failed level is not remembered")
    except kernel_compiler.BuildFailed as exc:
        assert "error: no AVX-512" in str(exc)
