"""verispec's CPU kernels that compute each row on its own: the quantized and the dense matmul and
the RMS norm, each against float64 within its arithmetic's bound, and each row's bits the same
whatever rows share the call (batch invariance). Rerun at every CPU level the machine can execute
(test_cpu_capabilities.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.models import cpu_kernels

EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# Skipped only where the kernels cannot exist (as in test_cpu_kernels.py): with a compiler present
# a failed build fails these tests.
pytestmark = pytest.mark.skipif(not cpu_kernels.kernels_wanted(),
                                reason="verispec's CPU kernels are off here (no C++ compiler, or VERISPEC_CPU_KERNELS=0)")


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
