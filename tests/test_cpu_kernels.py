"""verispec's CPU paged attention kernel against a float64 reference, and the property it exists
for: a row's output does not depend on how the step was cut (chunks, verify rows, batch mates)."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.models import cpu_kernels
from verispec.models.attention import (
    SeqSpan, build_attention_metadata, kernel_layout, new_layer_cache, paged_attention,
)

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


def reference(q, cache, spans, scale):
    """Causal attention in float64 over each span's cached keys (the step's own included); also
    the largest scale * sum_d |q_d k_d| over every (row, key) pair, for the rounding bound."""
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
        scores = scores.masked_fill(torch.arange(s.context_len)[None] > pos, float("-inf"))
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


def run(q, k, v, cache, spans, dtype):
    meta = build_attention_metadata(spans, BLOCK, torch.device("cpu"), dtype)
    return paged_attention(q, k, v, cache, meta, q.shape[-1] ** -0.5)


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
)
def test_a_row_computes_alike_however_the_step_is_cut(ctx, cuts, others, dtype):
    """The sequence's last rows, fed as one chunk or in the pieces `cuts` gives (each step's rows
    batched with unrelated sequences), produce bit-identical outputs."""
    kv_heads, per_kv, head_dim = 3, 3, 64
    n = min(sum(cuts), ctx)
    spans, q, k, v = random_step(kv_heads, per_kv, head_dim, dtype, [(n, ctx)], seed=ctx)
    table = spans[0].block_table  # drawn from blocks [0, len(table) + 4)
    first_free, num_blocks = len(table) + 4, len(table) + 44
    cache = make_cache(num_blocks, kv_heads, head_dim, dtype, seed=1)
    whole = run(q, k, v, cache, spans, dtype)
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
        out = run(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, step_spans, dtype)
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
        op(q, k, v, cache.k, cache.v, meta.slot_mapping, seqs.seqs, bad_table, 0.125, out)
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(q, k, v, cache.k, cache.v, meta.slot_mapping + 8 * BLOCK, seqs.seqs, seqs.tables, 0.125, out)
    too_long = seqs.seqs.clone()
    too_long[0, 2] = seqs.tables.shape[1] * BLOCK + 1  # more context than the table holds
    with pytest.raises(RuntimeError, match="does not fit"):
        op(q, k, v, cache.k, cache.v, meta.slot_mapping, too_long, seqs.tables, 0.125, out)


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
    assert log.read_text().splitlines() == ["x.cpp:1:2: error: no AVX-512 here", "more"] * len(cpu_kernels._SOURCES)
    assert str(log) in chosen.reason
    built = len(calls.read_text().splitlines())
    assert built == 2 * len(cpu_kernels._SOURCES) + 1  # each source at AVX512, then at AVX2, one link
    again = cpu_kernels.load_best(str(fake), ["AVX512", "AVX2", "DEFAULT"], loaded.append)
    assert again == chosen and len(calls.read_text().splitlines()) == built  # nothing recompiled


def test_every_level_has_flags_and_the_portable_build_has_none():
    assert cpu_kernels.build_levels("AVX512") == ["AVX512", "AVX2", "DEFAULT"]
    assert cpu_kernels.build_levels("AVX2") == ["AVX2", "DEFAULT"]
    assert cpu_kernels.build_levels("SVE256") == ["DEFAULT"]  # another architecture: portable only
    src, obj = cpu_kernels._SOURCES[0], cpu_kernels.Path("x.o")
    avx2 = cpu_kernels._compile_command("g++", src, obj, "AVX2")
    assert {"-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"} <= set(avx2)
    portable = cpu_kernels._compile_command("g++", src, obj, "DEFAULT")
    assert not [a for a in portable if a.startswith("-m") or "CPU_CAPABILITY" in a]


@pytest.mark.usefixtures("cpu_kernels_loaded")  # the test order is random: load them here
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [96, 100])  # 100: the last block of 16 columns is padded
def test_quant_linear_kernel_matches_float64_and_rows_do_not_interact(n, bits):
    from verispec.models.linear import DecodedLinear
    from verispec.models.quant import quantize_rtn

    k = 128
    g = torch.Generator().manual_seed(n + bits)
    weight = quantize_rtn(torch.randn(n, k, generator=g), bits=bits)
    # GGUF's scales (and Q4_1's offsets) are fp16: every weight decodes exactly.
    weight.scale = weight.scale.half().float()
    if weight.offset is not None:
        weight.offset = weight.offset.half().float()
    head = DecodedLinear(weight, torch.device("cpu"))
    w = weight.dequantize().double()
    for rows in (1, 5, 17):  # 17: two full tiles of 8 rows and one more
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        y = head(x)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        # fp32 sums of k exact products: error <= k * eps32 * sum |x w|.
        bound = k * 2.0**-24 * (x.double().abs() @ w.abs().t())
        assert ((y.double() - x.double() @ w.t()).abs() <= bound).all()
        assert torch.equal(y, torch.cat([head(x[i : i + 1]) for i in range(rows)]))


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_an_8_bit_lm_head_runs_on_the_kernels_with_fp32_logits(tiny_llama):
    """The fast tier's on the packed kernel, the exact tier on the codes' on the decoding one."""
    from verispec.models.linear import DecodedLinear, PackedLinear
    from verispec.models.llama import LlamaModel
    from verispec.models.loader import load_checkpoint

    cfg, weights = load_checkpoint(tiny_llama, torch.bfloat16, "int8")
    model = LlamaModel(cfg, weights)
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.float_output
    assert model.compute_logits(torch.randn(3, cfg.hidden_size).bfloat16()).dtype == torch.float32
    exact = LlamaModel(cfg, weights, dtype=torch.float32)
    assert isinstance(exact.lm_head, DecodedLinear)
    assert exact.compute_logits(torch.randn(3, cfg.hidden_size)).dtype == torch.float32


def one_order_rms_norm(x, w, eps):
    """verispec_cpu::rms_norm's arithmetic in torch's correctly rounded elementwise fp32 ops: the
    squares into 16 lanes in order, the lanes summed pairwise, one rounding before the scale."""
    d, lanes = x.shape[-1], 16
    sq = x.float().reshape(-1, d) ** 2  # exact: a bf16 / fp16 square fits fp32
    acc = torch.zeros(sq.shape[0], lanes)
    for i in range(0, d - d % lanes, lanes):
        acc += sq[:, i : i + lanes]
    acc[:, : d % lanes] += sq[:, d - d % lanes :]
    width = lanes // 2
    while width:
        acc = acc[:, :width] + acc[:, width : 2 * width]
        width //= 2
    # The row's scalars in numpy's float32, which rounds each step correctly everywhere (torch's
    # sqrt may run on MKL's vector math, within an ulp, at some instruction sets).
    total = acc[:, 0].numpy()
    inv = torch.from_numpy(np.float32(1) / np.sqrt(total / np.float32(d) + np.float32(eps)))[:, None]
    normed = (x.float().reshape(-1, d) * inv).to(x.dtype)
    return (w.float() * normed.float()).to(x.dtype).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [576, 64, 100, 7])
def test_rms_norm_computes_its_one_order_bit_for_bit(cpu_kernels_loaded, dtype, d):
    """The same bits at every level (this module reruns at each): an emulation of the op's order
    in elementwise torch ops, which round correctly everywhere. And within the arithmetic's bound
    of the float64 value: the normalised row before its one rounding is off by a few fp32 units
    (d additions), so it rounds to one of the two neighbours of the exact value."""
    g = torch.Generator().manual_seed(d)
    # Log-normal magnitudes: a few huge entries, as in a residual stream, make the order matter.
    x = (torch.randn(300, d, generator=g) * torch.randn(300, d, generator=g).mul(1.5).exp()).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    y = torch.ops.verispec_cpu.rms_norm(x, w, 1e-5)
    assert y.dtype == dtype and torch.equal(y, one_order_rms_norm(x, w, 1e-5))
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    # Two roundings to the dtype (normalised, then scaled) and a few fp32 units before them; fp16's
    # subnormals round by an absolute step.
    want = w.double() * exact
    subnormal = torch.finfo(dtype).tiny * 2 * EPS[dtype] * (1 + w.double())
    assert ((y.double() - want).abs() <= 2.1 * EPS[dtype] * want.abs() + subnormal).all()


@pytest.mark.parametrize("d", [576, 100, 7])
def test_fp32_rms_norm_is_one_order_within_the_bound(cpu_kernels_loaded, d):
    """The exact tier's norm on the op (compiled and eager alike): each row's bits do not depend
    on the rows beside it, and it is within fp32's bound of float64: d rounded squares and sums
    (d + 1 units), half that through the square root, two more roundings."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(300, d, generator=g) * torch.randn(300, d, generator=g).mul(1.5).exp()
    w = torch.rand(d, generator=g) + 0.5
    y = torch.ops.verispec_cpu.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float32
    assert torch.equal(y[7:8], torch.ops.verispec_cpu.rms_norm(x[7:8], w, 1e-5))
    xd = x.double()
    want = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert ((y.double() - want).abs() <= (d / 2 + 4) * 2.0**-24 * want.abs()).all()


def test_rms_norm_takes_any_leading_shape_and_strides_and_refuses_mismatches(cpu_kernels_loaded):
    x = torch.randn(4, 6, 32).bfloat16()
    w = torch.rand(32).bfloat16()
    view = x[:, 2:]  # a non-contiguous view, as a Qwen3 q / k head slice is
    assert torch.equal(torch.ops.verispec_cpu.rms_norm(view, w, 1e-6), one_order_rms_norm(view.contiguous(), w, 1e-6))
    with pytest.raises(RuntimeError, match="last dimension"):
        torch.ops.verispec_cpu.rms_norm(x, torch.rand(16).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.verispec_cpu.rms_norm(x.float(), w, 1e-6)


@pytest.mark.usefixtures("cpu_kernels_loaded")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [96, 100])  # 100: the last block of 16 columns is padded
def test_dense_linear_kernel_matches_float64_and_rows_do_not_interact(n, dtype):
    """The dense matmul (fp32: the exact tier; bf16 / fp16 weights and activations: a dense
    half-precision model): within fp32's bound of the float64 product of the same values, plus
    one rounding of the output to the dtype, and each row's bits the same whatever rows share the
    call, in any order (batch invariance), a call of 150 rows (three panels) included."""
    from verispec.models.linear import DenseLinear

    k = 160
    g = torch.Generator().manual_seed(n)
    w, bias = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    dense = DenseLinear(w, bias)
    unit = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2  # the output's one rounding
    for rows in (1, 5, 17, 150):  # 17: two full tiles of 8 rows and one more
        x = torch.randn(rows, k, generator=g).to(dtype)
        y = dense(x)
        assert y.dtype == dtype and y.shape == (rows, n)
        exact = x.double() @ w.double().t() + bias.double()
        bound = (k + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
        assert ((y.double() - exact).abs() <= bound * (1 + unit) + unit * exact.abs()).all()
        alone = torch.cat([dense(x[i : i + 1]) for i in range(rows)])
        assert torch.equal(y, alone) and torch.equal(dense(x.flip(0)), alone.flip(0))
    assert torch.equal(dense.matrix(), w)
