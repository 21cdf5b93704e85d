"""The real-files benchmark's pieces that run without a 1B model: the table, the scenario's place
in the options (named only), and the llama.cpp build's feature probe (features are those the CPU
executes: a probe the compiler could fold away would list AVX-512 on an AVX2-only CPU)."""

from __future__ import annotations

import argparse
import shutil

import pytest

from benchmarks.build_llama_cpp import _PROBES, executable_features
from benchmarks.formats import FormatRow, format_formats
from benchmarks.options import add_arguments, resolve


def test_the_table_gives_ratios_and_dashes_without_the_peer():
    rows = [FormatRow("Q4_K_M", 1, 636.0, 15.0, 33.0, 16.6, 700.0, 760.0, "verispec AVX2, compiled", 17.8, 40.8),
            FormatRow("Q4_0", 2, 601.0, 30.0, 80.0, 15.0, 650.0, 700.0, "verispec AVX2, eager")]
    table = format_formats(rows).splitlines()
    assert table[2] == ("| 1B Q4_K_M | 1 | 15.00 (17.80) | 0.84x | 33.0 (40.8) | 0.81x | 700 / 760 (636) | 16.6 s "
                        "| verispec AVX2, compiled |")
    assert "| 1B Q4_0 | 2 | 30.00 (-) | - | 80.0 (-) | - |" in table[3]


def test_formats_is_named_only():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert not {"formats", "serving"} & set(resolve(parser.parse_args([])).scenarios)
    assert resolve(parser.parse_args(["--scenarios", "formats"])).scenarios == ["formats"]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the probe compiles with gcc")
def test_the_feature_probe_lists_what_the_cpu_runs():
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    found = executable_features()
    assert set(found) <= set(_PROBES)
    assert ("GGML_AVX2" in found) == ("avx2" in flags)
    if "avx512f" not in flags:  # listed features may still fault; unlisted ones must never pass
        assert not [f for f in found if f.startswith("GGML_AVX512")]


def test_the_serving_table_gives_ratios_and_names_the_peers_setting():
    from benchmarks.serving import ServingRow, format_serving

    table = format_serving([ServingRow("chat x16", 1, 312.7, 76.7, "-np 16"),
                            ServingRow("extractive", 2, 50.0, None)]).splitlines()
    assert table[2] == "| chat x16 | 1 | 312.7 | 76.7 (-np 16) | 4.08x |"
    assert table[3] == "| extractive | 2 | 50.0 | - | - |"
