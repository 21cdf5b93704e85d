"""Quantized weights (verispec.models.quant) and the linear layers that run them (models.linear).

Decoding is checked for bit-exactness against the gguf package's own dequantize; the kernels
against the dequantized fp32 matrix, within the rounding bound of bf16 arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.models.linear import Int4Plane, QuantLinear, make_linear, pack_nibbles, unpack_nibbles
from verispec.models.quant import QuantizedWeight, concat_rows, from_gguf_blocks, quantize_rtn

BF16_EPS = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_exactly(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    blocks = quantize(w, qtype)
    ours = from_gguf_blocks(blocks, kind, (48, 96))
    assert ours.bits == (8 if kind == "Q8_0" else 4)
    assert torch.equal(ours.dequantize(), torch.from_numpy(dequantize(blocks, qtype).reshape(48, 96)))


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_is_within_half_a_step(bits):
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) * 3
    q = quantize_rtn(w, bits)
    err = (q.dequantize() - w).abs().view(32, 4, 32)
    assert (err <= q.scale[..., None] / 2 * (1 + 1e-5) + 1e-6).all()
    if bits == 4:
        assert int(q.codes.max()) == 15 and int(q.codes.min()) == 0
    else:
        assert int(q.codes.abs().max()) == 127


def test_concat_rows_keeps_one_format_and_falls_back_to_dense_for_a_mix():
    g = torch.Generator().manual_seed(2)
    a, b = quantize_rtn(torch.randn(16, 64, generator=g), 4), quantize_rtn(torch.randn(8, 64, generator=g), 4)
    both = concat_rows([a, b])
    assert isinstance(both, QuantizedWeight) and both.shape == (24, 64)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = quantize_rtn(torch.randn(8, 64, generator=g), 8)
    mixed = concat_rows([a, c])
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([a.dequantize(), c.dequantize()]))


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (70, 96), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (70, 48) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0], codes[:, 0] | (codes[:, 1] << 4))
    assert torch.equal(unpack_nibbles(packed), codes)


@pytest.mark.parametrize("n", [64, 200])  # 200: torch pads N to its packing's multiple of 64
def test_the_dense_path_decodes_the_matrix_the_kernel_computes_with(n):
    """torch's packed layout is private and changes with the CPU capability; the dense path reads
    verispec's own copy of the codes. torch's kernel applied to the identity is torch's own decode:
    each output is one code's (c - 8) * S + Z, rounded once to bf16. Under a scrambled layout most
    entries would be another weight's value, off by whole scale steps."""
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 16, (n, 128), generator=g, dtype=torch.uint8)
    scale, zero = torch.rand(n, 4, generator=g) + 0.1, torch.randn(n, 4, generator=g)
    plane = Int4Plane(codes, scale, zero, 32, torch.bfloat16, torch.device("cpu"))
    by_kernel = plane(torch.eye(128, dtype=torch.bfloat16)).t().float()  # [N, K]
    dense = plane.dense().float()
    assert dense.shape == (n, 128)
    s, z = plane.scales_and_zeros[:, :n].float().unbind(-1)  # [K/G, N] each, as the kernel sees them
    magnitude = (codes.float() - 8).abs() * s.t().repeat_interleave(32, 1) + z.t().abs().repeat_interleave(32, 1)
    assert ((dense - by_kernel).abs() <= BF16_EPS * magnitude).all()


def _bound(x: torch.Tensor, w: torch.Tensor, slack: float) -> torch.Tensor:
    """Elementwise error bound of a bf16 matmul: rounding x, the kernel's scales / zeros and the
    output each cost one bf16 unit relative to |x| @ |w|^T (accumulation is fp32)."""
    return slack * BF16_EPS * (x.abs() @ w.abs().t())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 100])  # 100 > kernel_max_rows: the dequantized dense path
@pytest.mark.parametrize("n", [96, 200])  # 200 is not a multiple of the packing's 64-row blocks
def test_quant_linear_matches_the_dequantized_matrix(bits, rows, n):
    """torch's int4 kernels: the fast tier's matmul on CUDA, and on a CPU without verispec's."""
    g = torch.Generator().manual_seed(bits * 1000 + rows + n)
    q = quantize_rtn(torch.randn(n, 128, generator=g), bits)
    bias = torch.randn(n, generator=g)
    layer = QuantLinear(q, torch.bfloat16, torch.device("cpu"), bias)
    assert len(layer.planes) == (1 if bits == 4 else 2)
    x = torch.randn(rows, 128, generator=g)
    w = q.dequantize()
    y = layer(x.bfloat16())
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    ref = x @ w.t() + bias
    # Two planes add one more bf16 rounding of a partial result.
    assert ((y.float() - ref).abs() <= _bound(x, w, 4.0 if bits == 4 else 6.0) + BF16_EPS * bias.abs()).all()
    residual = torch.randn(rows, n, generator=g).bfloat16()
    out = layer.forward_residual(x.bfloat16(), residual)
    assert ((out.float() - (residual.float() + x @ w.t())).abs()
            <= _bound(x, w, 6.0 if bits == 4 else 8.0) + BF16_EPS * residual.float().abs()).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_rows_do_not_interact(bits):
    """Up to the kernels' row limit a row's output is bit-identical whatever rows share its call:
    what makes speculative and plain decoding agree to the last bit within the fast tier."""
    g = torch.Generator().manual_seed(bits)
    layer = QuantLinear(quantize_rtn(torch.randn(200, 256, generator=g), bits), torch.bfloat16, torch.device("cpu"))
    x = torch.randn(layer.kernel_max_rows, 256, generator=g).bfloat16()
    whole = layer(x)
    for rows in (1, 2, 5, 6, 17):
        assert torch.equal(torch.cat([layer(x[i : i + rows]) for i in range(0, len(x), rows)]), whole)


def test_the_dense_path_runs_fp32_where_bf16_has_no_instructions(monkeypatch):
    """On a CPU without bf16 instructions (AVX2) the dense prefill matmul runs in fp32 on the same
    values; its output is still bf16, and closer to the exact product than the bf16 GEMM's."""
    from verispec.models import linear

    g = torch.Generator().manual_seed(9)
    q = quantize_rtn(torch.randn(96, 128, generator=g), 4)
    layer = make_linear(q, torch.bfloat16, torch.device("cpu"))
    x = torch.randn(100, 128, generator=g).bfloat16()
    ref = x.float() @ q.dequantize().t()
    linear._bf16_matmul_native.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert linear.dense_matmul_dtype(x) == torch.float32
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs() <= _bound(x.float(), q.dequantize(), 2.0)).all()
    linear._bf16_matmul_native.cache_clear()


def test_a_matrix_the_kernels_cannot_take_runs_dense():
    q = quantize_rtn(torch.randn(16, 64), 4)
    q = QuantizedWeight(4, q.codes[:, :48], q.scale[:, :1].repeat(1, 3), q.offset[:, :1].repeat(1, 3), 16)
    layer = make_linear(q, torch.bfloat16, torch.device("cpu"))
    assert not isinstance(layer, QuantLinear)
    assert torch.equal(layer.matrix(), q.dequantize().bfloat16())  # dense: the decoded values, rounded once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 100])
def test_quant_linear_on_cuda(bits, rows):
    g = torch.Generator().manual_seed(bits + rows)
    q = quantize_rtn(torch.randn(256, 512, generator=g), bits)
    layer = make_linear(q, torch.bfloat16, torch.device("cuda"))
    x = torch.randn(rows, 512, generator=g)
    w = q.dequantize()
    y = layer(x.bfloat16().cuda()).float().cpu()
    assert ((y - x @ w.t()).abs() <= _bound(x, w, 6.0)).all()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_quantization_is_the_reference_bit_for_bit(kind):
    """verispec's torch quantizer against gguf's (llama.cpp's reference rounding), on blocks that
    probe the edges: zeros, constants, ties of magnitude, halves, and a wide spread of scales."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from verispec.models.quant import from_gguf_blocks, quantize_gguf

    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(64, 256, generator=g) * torch.logspace(-4, 2, 64)[:, None]]
    edge = torch.zeros(4, 256)
    edge[1] = 0.5  # a constant block
    edge[2, :32] = torch.tensor([3.0, -3.0] * 16)  # equal magnitudes of both signs
    edge[3] = (torch.arange(256) % 32 - 16) / 2  # exact halves
    rows.append(edge)
    x = torch.cat(rows)
    ref = from_gguf_blocks(quantize(x.numpy(), GGMLQuantizationType[kind]), kind, tuple(x.shape))
    ours = quantize_gguf(x, kind)
    assert ours.kind == ref.kind == kind and ours.bits == ref.bits
    assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale, ref.scale)
    assert (ours.offset is None and ref.offset is None) or torch.equal(ours.offset, ref.offset)
