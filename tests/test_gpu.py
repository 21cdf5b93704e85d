"""benchmarks/gpu.py (the CUDA check's figures): its rows and table, run here on the CPU with a tiny model.
The figures themselves need a GPU (`python -m benchmarks.gpu`); what is checked here is that each
row measures what it names: drafts only in drafter rows, exactly the asked tokens, ratios to the
exact plain row of the same workload."""

from __future__ import annotations

import pytest

from benchmarks import gpu
from benchmarks.gpu import GpuRow, format_rows, hf_rows, verispec_rows
from conftest import hf_model

LOADS = {"chat b1": [[5, 6, 7, 5, 6, 7, 5, 6]], "chat b2": [[9, 10, 11, 9, 10, 11], [3, 4, 3, 4, 3, 4, 3]]}


@pytest.mark.parametrize("drafter", list(gpu.DRAFTERS))
def test_verispec_rows_time_every_workload_and_count_drafts_only_with_a_drafter(tiny_llama, drafter, monkeypatch):
    # A tiny random model rarely repeats a bigram; prompt lookup from one token drafts here.
    ngram = f"ngram k={gpu.SPEC_K}"
    monkeypatch.setitem(gpu.DRAFTERS, ngram, {**gpu.DRAFTERS[ngram], "prompt_lookup_min": 1})
    rows = verispec_rows(tiny_llama, "exact", drafter, LOADS, max_tokens=24, runs=1, device="cpu")
    assert [r.workload for r in rows] == list(LOADS)
    assert all(r.system == f"verispec exact + {drafter}" and r.tok_s > 0 for r in rows)
    if drafter == "plain":
        assert all(r.mean_acceptance_length is None for r in rows)
    else:  # the tiny model's greedy loops draft; an acceptance length counts the bonus token too
        lengths = [r.mean_acceptance_length for r in rows if r.mean_acceptance_length is not None]
        assert lengths and min(lengths) >= 1


def test_hf_rows_time_the_benchmarks_hf_system_with_prompt_lookup_at_batch_one_only(tiny_with_tokenizer, monkeypatch):
    from benchmarks import peers
    from benchmarks.prompts import Prompt
    from verispec.models.tokenizer_cache import load_tokenizer

    monkeypatch.setattr(peers, "load_hf_model", lambda path: hf_model(path))
    tokenizer = load_tokenizer(tiny_with_tokenizer)
    tokenizer.pad_token = "t0"  # the word-level test tokenizer has no pad or EOS token of its own
    hf = peers.HFSystem(tiny_with_tokenizer, tokenizer)
    loads = {name: [Prompt("", "", ids) for ids in prompts] for name, prompts in LOADS.items()}
    rows = hf_rows(hf, "HF fp32", loads, max_tokens=4, runs=1)
    assert [(r.workload, r.system) for r in rows] == [
        ("chat b1", "HF fp32"), ("chat b1", f"HF fp32 + prompt lookup k={gpu.SPEC_K}"), ("chat b2", "HF fp32")]
    assert all(r.tok_s > 0 for r in rows)


def test_the_table_gives_each_row_against_exact_plain_on_its_own_workload():
    rows = [GpuRow("a", "verispec exact + plain", 100.0), GpuRow("a", "verispec fast + suffix", 250.0, 3.5),
            GpuRow("b", "HF bf16", 40.0)]
    lines = format_rows(rows).splitlines()
    assert lines[2] == "| a | verispec exact + plain | 100.0 | 1.00x | - |"
    assert lines[3] == "| a | verispec fast + suffix | 250.0 | 2.50x | 3.50 |"
    assert lines[4] == "| b | HF bf16 | 40.0 | - | - |"  # no exact plain row on b: no ratio


def test_it_refuses_to_run_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        gpu.main([])
    assert exc.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("drafter, engines", [("plain", 1), ("suffix", 2 * len(LOADS))])
def test_a_drafter_that_learns_across_requests_gets_a_fresh_engine_for_every_timed_run(tiny_llama, monkeypatch,
                                                                                       drafter, engines):
    """A suffix engine kept across runs would draft the answers its warm-up gave: a rerun, not serving."""
    import verispec

    built = []

    class Counting(verispec.LLM):
        def __init__(self, *args, **kwargs):
            built.append(kwargs["speculative_config"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(verispec, "LLM", Counting)
    verispec_rows(tiny_llama, "exact", drafter, LOADS, max_tokens=4, runs=2, device="cpu")
    assert len(built) == engines
