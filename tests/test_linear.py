"""The linear layers other than the packed kernel (verispec/models/linear.py; `PackedLinear` is
test_packed_linear.py's): the dense layer against `F.linear`, the nibble packing round trip, the
int4 planes' matrices against the quantized weight's exact values, `QuantLinear` against a float64
matmul on both of its paths, the packed-format rules and `make_linear`'s choice of layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.models import cpu_kernels
from verispec.models.linear import (
    PACKED_FORMATS, DecodedLinear, Linear, QuantLinear, make_linear, pack_nibbles, packed_format,
    unpack_nibbles,
)
from verispec.models.quant import QuantizedWeight, quantize_rtn

CPU = torch.device("cpu")


def weight(n=64, k=128, seed=0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_the_dense_layer_is_f_linear_plus_bias():
    w, b, x = weight(8, 16), torch.randn(8), torch.randn(3, 16)
    layer = Linear(w, b)
    assert torch.allclose(layer(x), F.linear(x, w, b), atol=1e-6)
    residual = torch.randn(3, 8)
    assert torch.allclose(Linear(w).forward_residual(x, residual), residual + F.linear(x, w), atol=1e-6)


def test_nibbles_round_trip_and_put_even_codes_low():
    codes = torch.randint(0, 16, (5, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 16) and packed[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)
    assert torch.equal(unpack_nibbles(packed), codes)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_int4_planes_hold_the_quantized_matrix_exactly(bits):
    q = quantize_rtn(weight(), bits)
    layer = QuantLinear(q, torch.float32, CPU)
    planes = [p.dense(torch.float32) for p in layer.planes]
    assert torch.allclose(sum(planes), q.dequantize(), atol=1e-5)


@pytest.mark.parametrize("rows", [2, 100])  # the int4 kernel, then the dense path past kernel_max_rows
def test_quant_linear_computes_the_quantized_matrix(rows):
    q = quantize_rtn(weight(seed=2), 4)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3))
    got = QuantLinear(q, torch.float32, CPU, kernel_max_rows=64)(x)
    ref = x.double() @ q.dequantize().double().t()
    assert (got.double() - ref).abs().max() < 1e-3


def test_packed_format_follows_gguf_block_rules():
    q4 = quantize_rtn(weight(), 4)
    assert packed_format(q4) == PACKED_FORMATS["Q4_1"]
    assert packed_format(quantize_rtn(weight(), 8)) == PACKED_FORMATS["Q8_0"]
    q4_0 = QuantizedWeight(4, q4.codes, q4.scale, -8 * q4.scale)
    assert packed_format(q4_0) == PACKED_FORMATS["Q4_0"]
    inexact = QuantizedWeight(4, q4.codes, q4.scale + 1e-7, q4.offset)  # fp16 cannot hold these scales
    assert packed_format(inexact) is None


def test_make_linear_picks_the_layer_for_the_weight():
    from verispec.models.linear import DenseLinear

    # Dense fp32, bf16 and fp16: verispec's row-invariant kernel where it is loaded, else torch's matmul.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dense = make_linear(weight(8, 16), dtype, CPU)
        assert isinstance(dense, DenseLinear if cpu_kernels.cpu_kernels_available() else Linear)
        assert dense.matrix().dtype == dtype
    q = quantize_rtn(weight(), 4)
    fp32 = make_linear(q, torch.float32, CPU)
    # The exact tier: decoded codes on verispec's kernel, or the same values dense without it.
    assert isinstance(fp32, DecodedLinear if cpu_kernels.cpu_kernels_available() else Linear)
    odd = quantize_rtn(weight(8, 96), 4, group_size=96)  # no int4 kernel takes groups of 96
    assert isinstance(make_linear(odd, torch.bfloat16, CPU), DenseLinear if cpu_kernels.cpu_kernels_available() else Linear)


def test_a_part_of_a_dense_matrix_is_written_where_its_rows_live():
    """Linear (transposed) and DenseLinear (blocks of 16 rows) place rows a..b of W the same way;
    a DenseLinear part that splits a block of 16 is refused (the caller rebuilds the matrix)."""
    from verispec.models.linear import DenseLinear, _blocked

    w, new = weight(48, 32), weight(16, 32) + 1
    for module in (Linear(w.t().contiguous().t()), DenseLinear(w) if cpu_kernels.cpu_kernels_available() else None):
        if module is None:
            continue
        dest, src = module.part(16, 16, new)
        dest.copy_(src)
        assert torch.equal(module.matrix(), torch.cat([w[:16], new, w[32:]]))
    if cpu_kernels.cpu_kernels_available():
        assert DenseLinear(w).part(8, 16, new) is None
        assert torch.equal(_blocked(w)[1], w[16:32].t())
