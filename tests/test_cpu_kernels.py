"""verispec's CPU paged attention kernel against a float64 reference, and the property it exists
for: a row's output does not depend on how the step was cut (chunks, verify rows, batch mates)."""

from __future__ import annotations

import logging
import os
import random
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_kernel_compiler import fake_compiler, wait_for_builder
from verispec import LLM, SamplingParams
from verispec.models import cpu_kernels, kernel_compiler
from verispec.models.attention import SeqSpan, build_attention_metadata, paged_attention
from verispec.models.kv_cache_tensors import kernel_layout, new_layer_cache

BLOCK = 16
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# Skipped only where the kernels cannot exist. With a compiler present a build that fails fails
# these tests (and `test_kernels_build_at_torchs_own_level`): it is never a silent fallback.
pytestmark = pytest.mark.skipif(not cpu_kernels.kernels_wanted(),
                                reason="verispec's CPU kernels are off here (no C++ compiler, or VERISPEC_CPU_KERNELS=0)")


def make_cache(num_blocks, kv_heads, head_dim, dtype, seed=0):
    """A layer cache in the kernel's layout, filled with noise (stale slots must never be read)."""
    cache = new_layer_cache(num_blocks, BLOCK, kv_heads, head_dim, dtype, "cpu")
    assert cache.keys_transposed
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def keys_of(cache):
    """[blocks, block, KV, D] view of the transposed key cache."""
    return cache.k.permute(0, 3, 1, 2)


def reference(q, cache, spans, scale, window=0, softcap=0.0):
    """Causal attention in float64 over each span's cached keys (the step's own included; with a
    window, only the last `window` of them; with a soft-cap, scores capped); also the largest
    scale * sum_d |q_d k_d| over every (row, key) pair, for the rounding bound."""
    out, qk_abs = torch.zeros(q.shape, dtype=torch.float64), 0.0
    kv_heads, head_dim = cache.v.shape[2], cache.v.shape[3]
    per_kv = q.shape[1] // kv_heads
    for s in spans:
        nb = -(-s.context_len // BLOCK)
        k = keys_of(cache)[s.block_table[:nb]].reshape(-1, kv_heads, head_dim)[: s.context_len].double()
        v = cache.v[s.block_table[:nb]].reshape(-1, kv_heads, head_dim)[: s.context_len].double()
        k, v = k.repeat_interleave(per_kv, 1), v.repeat_interleave(per_kv, 1)  # [ctx, H, D]
        qs = q[s.start : s.start + s.num_query].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qk_abs = max(qk_abs, float(torch.einsum("qhd,khd->hqk", qs.abs(), k.abs()).amax()) * scale)
        pos = torch.arange(s.num_query)[:, None] + s.context_len - s.num_query
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        keys = torch.arange(s.context_len)[None]
        scores = scores.masked_fill((keys > pos) | ((keys <= pos - window) if window else False), float("-inf"))
        out[s.start : s.start + s.num_query] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out, qk_abs


def random_step(kv_heads, per_kv, head_dim, dtype, shapes, seed=0):
    """Spans of (query rows, context length) over scattered blocks, with their q, k, v rows."""
    rng = random.Random(seed)
    blocks = list(range(sum(-(-ctx // BLOCK) for _, ctx in shapes) + 4))
    rng.shuffle(blocks)
    spans, start = [], 0
    for nq, ctx in shapes:
        nb = -(-ctx // BLOCK)
        spans.append(SeqSpan(start, nq, ctx, blocks[:nb]))
        blocks, start = blocks[nb:], start + nq
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(start, kv_heads * per_kv, head_dim, generator=g).to(dtype)
    k = torch.randn(start, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(start, kv_heads, head_dim, generator=g).to(dtype)
    return spans, q, k, v


def run(q, k, v, cache, spans, dtype, window=0, softcap=0.0):
    meta = build_attention_metadata(spans, BLOCK, torch.device("cpu"), dtype)
    return paged_attention(q, k, v, cache, meta, q.shape[-1] ** -0.5, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads, per_kv, head_dim", [(3, 3, 64), (2, 2, 80), (4, 1, 32), (1, 4, 128)])
def test_kernel_matches_float64_attention(dtype, kv_heads, per_kv, head_dim):
    # A decode row, a verify step, a fresh prefill chunk, a chunk with history, a 1-token context.
    shapes = [(1, 37), (6, 100), (40, 40), (23, 90), (1, 1)]
    spans, q, k, v = random_step(kv_heads, per_kv, head_dim, dtype, shapes)
    cache = make_cache(64, kv_heads, head_dim, dtype)
    out = run(q, k, v, cache, spans, dtype)
    # The step's keys and values landed in their slots.
    meta = build_attention_metadata(spans, BLOCK, torch.device("cpu"), dtype)
    assert torch.equal(keys_of(cache).reshape(-1, kv_heads, head_dim)[meta.slot_mapping], k)
    assert torch.equal(cache.v.reshape(-1, kv_heads, head_dim)[meta.slot_mapping], v)
    ref, qk_abs = reference(q, cache, spans, head_dim**-0.5)
    # fp32 arithmetic: each score sums head_dim products (error <= head_dim * eps * sum |q k|), a
    # softmax weight's relative error follows the score's absolute one, and the output sums up to
    # max_ctx weighted values. Then the output is rounded to the dtype. (A key too many or too few
    # moves an output by about max|v| / context, far above this.)
    eps32, vmax = 2.0**-24, float(cache.v.abs().max())
    bound = 4 * vmax * eps32 * (head_dim * qk_abs + max(c for _, c in shapes)) + EPS[dtype] * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_attend_in_parts_within_the_fp32_bound(dtype):
    """Contexts past one part of keys (256): a decode row and a verify step over 700 keys, a chunk
    whose first rows see one part and last rows three, and a context of exactly two parts."""
    kv_heads, per_kv, head_dim = 3, 3, 64
    shapes = [(1, 700), (6, 613), (40, 530), (1, 512)]
    spans, q, k, v = random_step(kv_heads, per_kv, head_dim, dtype, shapes, seed=3)
    cache = make_cache(sum(-(-c // BLOCK) for _, c in shapes) + 4, kv_heads, head_dim, dtype)
    out = run(q, k, v, cache, spans, dtype)
    ref, qk_abs = reference(q, cache, spans, head_dim**-0.5)
    # As above, plus each part's weight exp(m_p - m) and the parts' sum: a few more roundings.
    eps32, vmax = 2.0**-24, float(cache.v.abs().max())
    bound = 8 * vmax * eps32 * (head_dim * qk_abs + max(c for _, c in shapes)) + EPS[dtype] * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(1, 0.0), (100, 0.0), (300, 2.0), (0, 2.0)])
def test_sliding_windows_and_soft_caps_within_the_fp32_bound(dtype, window, softcap):
    """Gemma's and Mistral's sliding layers and Gemma 2's soft-capped scores: rows whose window
    ends inside a part of keys, parts wholly behind every row's window (skipped), a window of one
    key (a row sees itself alone), a window wider than a part. (Capped scores are smaller: the
    bound above still holds.)"""
    kv_heads, per_kv, head_dim = 2, 2, 64
    shapes = [(1, 700), (6, 613), (40, 530), (23, 90), (1, 1)]
    spans, q, k, v = random_step(kv_heads, per_kv, head_dim, dtype, shapes, seed=4)
    cache = make_cache(sum(-(-c // BLOCK) for _, c in shapes) + 4, kv_heads, head_dim, dtype)
    out = run(q, k, v, cache, spans, dtype, window, softcap)
    ref, qk_abs = reference(q, cache, spans, head_dim**-0.5, window, softcap)
    eps32, vmax = 2.0**-24, float(cache.v.abs().max())
    bound = 8 * vmax * eps32 * (head_dim * qk_abs + max(c for _, c in shapes)) + EPS[dtype] * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_context_row_computes_alike_alone_or_beside_a_long_chunk(threads):
    """A few rows over 700 keys alone (few tiles: each part of the keys its own work item, the
    parts combined after) or beside another sequence's 200-row chunk (many tiles: a thread takes
    a tile's parts in turn), on one thread or two: the same bits."""
    kv_heads, per_kv, head_dim, dtype = 3, 3, 64, torch.bfloat16
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spans, q, k, v = random_step(kv_heads, per_kv, head_dim, dtype, [(200, 200), (6, 700)], seed=4)
        cache = make_cache(64, kv_heads, head_dim, dtype, seed=5)
        both = run(q, k, v, cache, spans, dtype)[200:]
        main = spans[1]
        alone = run(q[200:], k[200:], v[200:], cache, [SeqSpan(0, 6, 700, main.block_table)], dtype)
        decode = [run(q[200 + i : 201 + i], k[200 + i : 201 + i], v[200 + i : 201 + i], cache,
                      [SeqSpan(0, 1, 695 + i, main.block_table)], dtype) for i in range(6)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, both) and torch.equal(torch.cat(decode), both)


@settings(max_examples=25, deadline=None)
@given(
    ctx=st.integers(1, 150),
    cuts=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    others=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 60)), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    layer=st.sampled_from([(0, 0.0), (7, 0.0), (33, 0.0), (0, 3.0), (20, 3.0)]),
)
def test_a_row_computes_alike_however_the_step_is_cut(ctx, cuts, others, dtype, layer):
    """The sequence's last rows, fed as one chunk or in the pieces `cuts` gives (each step's rows
    batched with unrelated sequences), produce bit-identical outputs, in sliding-window and
    soft-capped layers too (`layer`: window, soft-cap)."""
    kv_heads, per_kv, head_dim = 3, 3, 64
    n = min(sum(cuts), ctx)
    spans, q, k, v = random_step(kv_heads, per_kv, head_dim, dtype, [(n, ctx)], seed=ctx)
    table = spans[0].block_table  # drawn from blocks [0, len(table) + 4)
    first_free, num_blocks = len(table) + 4, len(table) + 44
    cache = make_cache(num_blocks, kv_heads, head_dim, dtype, seed=1)
    whole = run(q, k, v, cache, spans, dtype, *layer)
    pieces, done = [], ctx - n
    for cut in cuts:
        cut = min(cut, ctx - done)
        if cut == 0:
            break
        rows = slice(done - (ctx - n), done - (ctx - n) + cut)
        # Unrelated sequences first, on blocks the main sequence does not use.
        step_spans, qs, ks, vs, start, free = [], [], [], [], 0, first_free
        for nq, extra in others:
            c = nq + extra
            nb = -(-c // BLOCK)
            if free + nb > num_blocks:
                break
            step_spans.append(SeqSpan(start, nq, c, list(range(free, free + nb))))
            g = torch.Generator().manual_seed(c)
            qs.append(torch.randn(nq, kv_heads * per_kv, head_dim, generator=g).to(dtype))
            ks.append(torch.randn(nq, kv_heads, head_dim, generator=g).to(dtype))
            vs.append(torch.randn(nq, kv_heads, head_dim, generator=g).to(dtype))
            start, free = start + nq, free + nb
        step_spans.append(SeqSpan(start, cut, done + cut, table))
        qs.append(q[rows]), ks.append(k[rows]), vs.append(v[rows])
        out = run(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, step_spans, dtype, *layer)
        pieces.append(out[start:])
        done += cut
    assert torch.equal(torch.cat(pieces), whole[: done - (ctx - n)])


def test_out_of_range_indices_raise_instead_of_reading_memory():
    spans, q, k, v = random_step(3, 3, 64, torch.float32, [(2, 20)])
    cache = make_cache(8, 3, 64, torch.float32)
    meta = build_attention_metadata(spans, BLOCK, torch.device("cpu"), torch.float32)
    op, seqs = torch.ops.verispec_cpu.paged_attention.default, meta.kernel
    out = torch.empty_like(q)
    bad_table = seqs.tables.clone().fill_(8)  # the cache has blocks 0..7
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(q, k, v, cache.k, cache.v, meta.slot_mapping, seqs.seqs, bad_table, 0.125, 0, 0.0, out)
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(q, k, v, cache.k, cache.v, meta.slot_mapping + 8 * BLOCK, seqs.seqs, seqs.tables, 0.125, 0, 0.0, out)
    too_long = seqs.seqs.clone()
    too_long[0, 2] = seqs.tables.shape[1] * BLOCK + 1  # more context than the table holds
    with pytest.raises(RuntimeError, match="does not fit"):
        op(q, k, v, cache.k, cache.v, meta.slot_mapping, too_long, seqs.tables, 0.125, 0, 0.0, out)


def test_kernels_build_at_torchs_own_level():
    """The level torch dispatches to in this process (ATEN_CPU_CAPABILITY lowers it), not a fallback."""
    capability = torch.backends.cpu.get_cpu_capability()
    build = cpu_kernels.kernel_build()
    assert build.level == (capability if capability in cpu_kernels.build_levels("AVX512") else "DEFAULT")
    assert build.reason == "", build.reason


def test_switches_and_missing_compiler_fall_back_to_sdpa(monkeypatch, tmp_path, caplog):
    kernel_build = cpu_kernels.kernel_build
    try:
        monkeypatch.setenv("VERISPEC_CPU_KERNELS", "0")
        kernel_build.cache_clear()
        assert not kernel_layout(torch.device("cpu"), BLOCK, 64)
        assert not new_layer_cache(2, BLOCK, 1, 64, torch.float32, "cpu").keys_transposed
        assert kernel_build().describe() == "off (VERISPEC_CPU_KERNELS=0)"
        monkeypatch.delenv("VERISPEC_CPU_KERNELS")
        monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))  # nothing built there yet
        monkeypatch.setenv("CXX", "false")  # a compiler that always fails
        kernel_build.cache_clear()
        with caplog.at_level(logging.WARNING, logger="verispec.kernels"):
            assert not cpu_kernels.cpu_kernels_available()
        assert "runs on SDPA" in caplog.text and len(caplog.records) == 1
    finally:
        monkeypatch.undo()
        kernel_build.cache_clear()
    assert cpu_kernels.cpu_kernels_available()


def test_a_failed_level_falls_back_once_and_is_remembered(monkeypatch, tmp_path):
    """A compiler that rejects AVX-512 flags: the AVX512 build fails with its first error line and
    a log of the full output, AVX2 is built and chosen, and the next start does not retry AVX512."""
    calls = tmp_path / "calls"
    fake = tmp_path / "fake-g++"
    fake.write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" >> {calls}\n"
        'case "$*" in *-mavx512f*) echo "x.cpp:1:2: error: no AVX-512 here" >&2; echo more >&2; exit 1;; esac\n'
        'while [ "$1" != "-o" ]; do shift; done; : > "$2"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    loaded = []
    chosen = cpu_kernels.load_best(str(fake), ["AVX512", "AVX2", "DEFAULT"], loaded.append)
    assert chosen.level == "AVX2" and len(loaded) == 1 and "avx2" in loaded[0]
    assert "the AVX512 build failed (fake-g++: x.cpp:1:2: error: no AVX-512 here)" in chosen.reason
    log = next((tmp_path / "cache" / "kernels").glob("*avx512*.log"))
    assert log.read_text().splitlines() == ["x.cpp:1:2: error: no AVX-512 here", "more"] * len(kernel_compiler._SOURCES)
    assert str(log) in chosen.reason
    built = len(calls.read_text().splitlines())
    assert built == 2 * len(kernel_compiler._SOURCES) + 1  # each source at AVX512, then at AVX2, one link
    again = cpu_kernels.load_best(str(fake), ["AVX512", "AVX2", "DEFAULT"], loaded.append)
    assert again == chosen and len(calls.read_text().splitlines()) == built  # nothing recompiled


def test_an_engine_answers_at_once_while_a_first_build_runs_in_the_background(monkeypatch, tmp_path, tiny_llama):
    """No library built yet: the engine starts the build in a background process, answers on torch's
    kernels (SDPA attention) without waiting for it, and says so; it runs on one thread fewer while
    the build runs, and on all its threads from the first step after the build ends."""
    fake, calls = fake_compiler(tmp_path, 60)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", fake)
    monkeypatch.setenv("VERISPEC_COMPILE", "1")
    monkeypatch.setenv("VERISPEC_ADAPTIVE_THREADS", "0")  # the build's share alone, whatever else runs
    cpu_kernels.kernel_build.cache_clear()
    threads = torch.get_num_threads()
    greedy = SamplingParams(temperature=0, max_tokens=4)
    try:
        started = time.monotonic()
        llm = LLM(tiny_llama, max_model_len=128, enforce_eager=False)
        out = llm.generate([[1, 2, 3]], greedy)[0]
        assert time.monotonic() - started < 50  # the build (two 60 s compiler calls) is not waited for
        assert len(out.outputs[0].token_ids) == 4
        assert llm.engine.runtime.kernels == "off (building in the background)"
        assert llm.engine.model.compiled is None  # nothing compiled around torch's kernels
        assert not kernel_layout(torch.device("cpu"), BLOCK, 64)  # attention on SDPA
        assert torch.get_num_threads() == max(1, threads - 1)  # a core left to the build
        builder = wait_for_builder()
        assert builder != os.getpid()  # still building, in its own process
        os.killpg(builder, signal.SIGKILL)  # the build ends (here: killed)
        assert cpu_kernels._share.ended.wait(30)
        assert llm.generate([[1, 2, 3]], greedy)[0].outputs[0].token_ids == out.outputs[0].token_ids
        assert torch.get_num_threads() == threads  # all of them again
    finally:
        if (pid := kernel_compiler.building_pid()) is not None:
            os.killpg(pid, signal.SIGKILL)
        monkeypatch.undo()
        cpu_kernels.kernel_build.cache_clear()
        torch.set_num_threads(threads)
    assert cpu_kernels.cpu_kernels_available()


def test_a_comparison_names_the_packed_variant_and_a_bad_name_lists_this_cpus(monkeypatch):
    """VERISPEC_PACKED_VARIANT picks the packed kernel's instruction set (the start-up line says which);
    one this CPU does not run is refused with the ones it does."""
    assert cpu_kernels.cpu_kernels_available()
    runs = torch.ops.verispec_cpu.packed_variants()
    assert cpu_kernels.packed_variant() == runs[0]
    monkeypatch.setenv("VERISPEC_PACKED_VARIANT", runs[-1])
    assert cpu_kernels.packed_variant() == runs[-1]
    assert cpu_kernels.kernel_build().describe().endswith(f"(packed {runs[-1]})")
    monkeypatch.setenv("VERISPEC_PACKED_VARIANT", "mmx")
    with pytest.raises(ValueError, match="VERISPEC_PACKED_VARIANT='mmx': this CPU runs " + ", ".join(runs)):
        cpu_kernels.packed_variant()
