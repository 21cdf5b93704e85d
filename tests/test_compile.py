"""The compiled layer stack (verispec.models.compile): oracle logits in the exact tier, exactness
within the fast tier, no recompiles after warm-up, and the eager fallbacks."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import TINY_VOCAB, assert_close_to_oracle, make_tiny_checkpoint, random_prompts
from test_fast_tier import NGRAM, assert_same_output
from test_llama import hf_logits, run_ours
from verispec import LLM, SamplingParams
from verispec.models import compile as compile_mod
from verispec.models import linear
from verispec.models import kernel_compiler
from verispec.models.cpu_kernels import kernels_wanted


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv("VERISPEC_COMPILE", "1")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_compiled_exact_tier_matches_hf(tiny_checkpoints, arch):
    """fp32 through the compiled graph (chunks and decode rows alike): within the fp32 bound."""
    path = tiny_checkpoints[arch]
    ids = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = run_ours(path, ids, [17, 19, 1, 1, 1, 1], compiled=True)
    assert_close_to_oracle(ours, hf_logits(path, ids))


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_compiled_exact_quantized_tier_matches_the_dense_decoded_weights(tiny_llama, monkeypatch, quantization):
    """fp32 on quantized codes (the CPU kernel inside the compiled graph) against eager fp32 on the
    same values decoded up front: within the fp32 bound, chunks and decode rows alike."""
    if not kernels_wanted():  # with a compiler, a failed kernel build fails this test instead
        pytest.skip("verispec's CPU kernels are off here (no C++ compiler, or VERISPEC_CPU_KERNELS=0)")
    ids = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = run_ours(tiny_llama, ids, [17, 19, 1, 1, 1, 1], compiled=True, quantization=quantization)
    monkeypatch.setattr(linear, "decoded_wanted", lambda weight, device: False)  # dense decoded values
    dense = run_ours(tiny_llama, ids, [17, 19, 1, 1, 1, 1], quantization=quantization)
    assert_close_to_oracle(ours, dense)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_compiled_fast_tier_speculative_equals_plain_without_recompiling(tiny_llama, compiling, quantization):
    """A serving-shaped run (staggered prompt lengths, so steps mix prefill chunks, decode rows and
    verify rows, 1 to 64 tokens and past it): no graph is compiled after warm-up, no request
    fails, and speculative output equals plain output (the compiled kernels are batch-invariant)."""
    prompts = [p + p[:10] for p in random_prompts(6, 6, 70, seed=31)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    kw = dict(quantization=quantization, max_num_batched_tokens=96)
    outputs = []
    for spec in (None, dict(NGRAM, adaptive_verification=True, cost_table=[[1, 1.0], [64, 1.2]])):
        llm = LLM(tiny_llama, speculative_config=spec, **kw)
        assert llm.engine.wait_for_compiled_step()
        graphs = counters["stats"]["unique_graphs"]
        out = llm.generate(prompts, params, use_tqdm=False)
        assert counters["stats"]["unique_graphs"] == graphs  # nothing traced in this process
        assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in out)
        outputs.append(out)
    print(f"compiled {quantization}: max |logprob spec - plain| = {assert_same_output(*outputs):.2e}")


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_the_compiled_fast_tier_rounds_as_eager_does(tiny_llama, compiling, quantization):
    """A step past the graph's 64 rows runs eager, so a decode row must compute alike on both
    paths, at any position: Inductor emulates eager's bf16 rounding of each op's result
    (`emulate_precision_casts`), the norms are verispec's op on both, and the rotary tables are
    computed eager before the graph (Inductor's sin rounds some positions differently)."""
    from verispec.models.attention import SeqSpan, build_attention_metadata

    llm = LLM(tiny_llama, quantization=quantization)
    model = llm.engine.model
    assert llm.engine.wait_for_compiled_step() and model.dtype == torch.bfloat16
    kv = model.new_kv_cache(8, 16)
    n = 64
    meta = build_attention_metadata([SeqSpan(0, n, n, list(range(4)))], 16, torch.device("cpu"), model.dtype)
    ids = torch.tensor(random_prompts(1, n, n + 1, seed=3)[0][:n])
    graphs = model.compiled
    with torch.inference_mode():
        for start in range(0, 4096, n):  # positions only move the rotary tables: the span stays put
            pos = torch.arange(start, start + n)
            model.compiled = graphs
            compiled = model(ids, pos, meta, kv.layers)  # the graphs
            model.compiled = None
            eager = model(ids, pos, meta, kv.layers)
            assert torch.equal(compiled.view(torch.int16), eager.view(torch.int16)), f"positions {start}.."
    model.compiled = graphs


def test_the_compiled_norm_rounds_as_eager_does(compiling):
    """Inductor's fused reduction sums a row's squares in its own order, which rounded about one
    row in 4000 of a residual stream's magnitudes differently from eager's F.rms_norm (and SmolLM2's
    batch-32 verify steps parted from its plain decode steps): the bf16 norm is verispec's op."""
    from verispec.models.llama import RMSNorm

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm((torch.rand(576, generator=g) + 0.5).bfloat16(), 1e-5)
    assert norm.fixed_order
    x = (torch.randn(16384, 576, generator=g) * torch.randn(16384, 576, generator=g).mul(2).exp()).bfloat16()
    compiled = torch.compile(norm, dynamic=True, options={"cpp_wrapper": True, "emulate_precision_casts": True})
    torch._dynamo.decorators.mark_unbacked(x, 0)
    with torch.inference_mode():
        assert torch.equal(compiled(x), norm(x))


def test_enforce_eager_and_the_environment_switch_compilation_off(tiny_llama, monkeypatch):
    monkeypatch.setenv("VERISPEC_COMPILE", "1")
    assert LLM(tiny_llama, enforce_eager=True).engine.model.compiled is None
    monkeypatch.setenv("VERISPEC_COMPILE", "0")
    assert LLM(tiny_llama).engine.model.compiled is None


def test_no_cpp_compiler_falls_back_to_eager(monkeypatch, caplog):
    monkeypatch.setenv("VERISPEC_COMPILE", "1")
    monkeypatch.setattr(kernel_compiler.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="verispec.compile"):
        assert not compile_mod.compile_wanted(False, torch.device("cpu"))
    assert "no C++ compiler" in caplog.text


def test_cuda_runs_eager_until_the_compiled_step_is_tested_there(monkeypatch):
    monkeypatch.setenv("VERISPEC_COMPILE", "1")
    assert not compile_mod.compile_wanted(False, torch.device("cuda"))
    assert compile_mod.compile_wanted(False, torch.device("cpu"))


def test_inductor_cache_is_per_capability_unless_the_user_chose_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from verispec.models.compile import inductor_cache_dir

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    level = torch.backends.cpu.get_cpu_capability().lower()
    for before in (None, default_cache_dir()):  # unset, or Inductor's shared default written on first use
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        assert inductor_cache_dir() == str(tmp_path / "inductor" / level)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache_dir() == str(tmp_path / "mine")


def _bits(outputs) -> list:
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.parametrize("tier", [dict(quantization="int4"), dict(dtype="float32")], ids=["fast", "exact"])
def test_a_request_that_spans_the_switch_to_the_compiled_step_keeps_its_bits(tiny_llama, compiling, monkeypatch, tier):
    """The engine answers eager while its graphs build and switches between two steps: sampled
    requests caught in the switch get the tokens and logprobs, bit for bit, of an eager run."""
    prompts = random_prompts(4, 6, 40, seed=7)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logprobs=3)
    eager = LLM(tiny_llama, enforce_eager=True, **tier).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama, **tier)
    assert llm.engine.wait_for_compiled_step()
    graphs = llm.engine.model.compiled
    pieces, graphs._pieces = graphs._pieces, None  # as if still building
    original, steps = llm.engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 6:  # mid-decode for every request
            graphs._pieces = pieces
        return original()

    monkeypatch.setattr(llm.engine, "step", step)
    switched = llm.generate(prompts, params, use_tqdm=False)
    assert graphs._announced and len(steps) > 6
    assert _bits(switched) == _bits(eager)


def test_the_worker_compiles_once_and_an_engine_with_other_limits_loads_its_graphs(tiny_llama, compiling, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold compile (the kernels stay built)
    first = LLM(tiny_llama, quantization="int4").engine
    assert first.wait_for_compiled_step(), first.model.compiled.error
    assert first.model.compiled._workers and all(w.returncode == 0 for w in first.model.compiled._workers)
    again = LLM(tiny_llama, quantization="int4", max_num_seqs=8, max_num_batched_tokens=256).engine
    assert again.wait_for_compiled_step(), again.model.compiled.error
    assert again.model.compiled._workers == []  # the saved graphs, loaded without tracing
    assert again.model.compiled.seconds < 10


def test_workers_share_the_graphs_and_together_save_the_whole_set(tmp_path, monkeypatch):
    """Graph i goes to worker i % shares (as `_switch` numbers them): two shares save what one
    worker would, and the set loads whole and computes eager's bits."""
    from verispec.models.attention import SeqSpan, build_attention_metadata

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    gemma3 = make_tiny_checkpoint(tmp_path / "gemma3", "gemma3")  # a sliding layer, then a global one
    model = LLM(gemma3, quantization="int4", enforce_eager=True).engine.model
    real_plan = compile_mod.plan_pieces  # a piece per layer: two pieces, two graphs
    monkeypatch.setattr(compile_mod, "plan_pieces", lambda layers, every=False: real_plan(layers, every, per_graph=1))
    graphs = compile_mod.LayerGraphs(model, 16)
    save = tmp_path / "graphs"
    save.mkdir()
    graphs.build_share(save, 1, 2)
    assert sorted(p.name for p in save.iterdir()) == ["1.json"]
    graphs.build_share(save, 0, 2)
    assert sorted(p.name for p in save.iterdir()) == ["0.json", "1.json"]
    graphs.load(save)
    assert graphs.ready and graphs.num_graphs == 2
    kv = model.new_kv_cache(4, 16)
    meta = build_attention_metadata([SeqSpan(0, 8, 8, [0])], 16, torch.device("cpu"), model.dtype)
    ids, pos = torch.tensor(random_prompts(1, 8, 9, seed=5)[0][:8]), torch.arange(8)
    with torch.inference_mode():
        model.compiled = graphs
        compiled = model(ids, pos, meta, kv.layers)
        model.compiled = None
        eager = model(ids, pos, meta, kv.layers)
    assert torch.equal(compiled.view(torch.int16), eager.view(torch.int16))


def test_an_exit_while_the_worker_compiles_is_clean(tiny_llama, tmp_path):
    """The script ends at once, the graphs still building: the worker is stopped, and the exit is
    clean (a thread killed inside torch's C++ at exit would abort the process)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), VERISPEC_COMPILE="1", HF_HUB_OFFLINE="1")
    script = f"from verispec import LLM; LLM({tiny_llama!r}, quantization='int4'); print('done')"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-2000:]
    assert "terminate called" not in run.stderr
