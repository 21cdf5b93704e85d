"""`verispec bench` (verispec alone): options, the measurement on a tiny model, the table."""

from __future__ import annotations

import argparse

import pytest

from verispec import LLM
from verispec.entrypoints.bench import BenchResult, add_arguments, batch_sizes, format_table, measure
from verispec.entrypoints.cli import main


def test_batch_sizes_parse_or_name_the_option():
    assert batch_sizes("1, 16,4") == [1, 16, 4]
    for bad in ("", "0", "a,2", "-1"):
        with pytest.raises(ValueError, match="--batch-sizes"):
            batch_sizes(bad)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.max_tokens, args.batch_sizes, args.runs, args.json) == (128, "1,16", 3, False)


def test_a_bad_option_exits_2_before_loading_a_model(capsys, tmp_path):
    assert main(["bench", "--model", str(tmp_path / "absent"), "--batch-sizes", "0"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err


def test_measure_counts_every_token_and_its_phases(tiny_llama):
    llm = LLM(tiny_llama, max_num_seqs=4)
    r = measure(llm, list(range(3, 20)), batch=3, max_tokens=5, runs=2)
    assert r.batch_size == 3 and r.ttft_ms > 0 and r.step_ms > 0 and r.tok_s > 0
    assert r.mean_acceptance_length is None  # no speculation
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    # Self-speculation drafts at every step (prompt lookup might find nothing to propose).
    spec = LLM(tiny_llama, speculative_config={"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2})
    s = measure(spec, [5, 6, 7, 5, 6, 7, 5, 6], batch=1, max_tokens=8, runs=1)
    assert s.mean_acceptance_length is not None and 1.0 <= s.mean_acceptance_length <= 3.0


def test_table():
    lines = format_table([BenchResult(1, 12.34, 5.678, 90.0, None), BenchResult(16, 50.0, 9.0, 400.0, 2.5)]).splitlines()
    assert lines[0].startswith("| batch | TTFT ms |") and lines[1].startswith("|---|")
    assert lines[2] == "| 1 | 12.3 | 5.68 | 90.0 | - |" and lines[3] == "| 16 | 50.0 | 9.00 | 400.0 | 2.50 |"
