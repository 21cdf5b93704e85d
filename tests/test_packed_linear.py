"""The fast tier's packed kernel (`csrc/packed_linear.cpp`, `PackedLinear`) against float64
references, and the properties it promises: every instruction-set variant this build and CPU run
gives the portable variant's bits; a row's result does not depend on the rows beside it; the file's
blocks decode exactly; past the kernel's rows the dense path computes the same matrix.

The error bounds come from the arithmetic. Activations are quantized per group of 32
(`quantized_activations`, as csrc/packed_activations.h does in fp32): for 8-bit codes to int16,
x^ = s q with s = max|x| / 32767; for 4-bit codes to int8, s1 = max|x| / 127, plus an int8 residual
on the step s1 / 254 in outlier groups (max|x| > 4 rms, judged on the int8 values). Either way |x - x^| is at most half the
group's step; each group's integer dot product is exact; the fp32 part is a few roundings per
group (`fp32_bound`)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.models import cpu_kernels
from verispec.models.linear import PACKED_FORMATS, PackedLinear, QuantLinear, make_linear, packed_format
from verispec.models.quant import QuantizedWeight, quantize_rtn

pytestmark = [pytest.mark.skipif(not cpu_kernels.kernels_wanted(),
                                 reason="verispec's CPU kernels are off here (no C++ compiler, or VERISPEC_CPU_KERNELS=0)"),
              pytest.mark.usefixtures("cpu_kernels_loaded")]
EPS32 = 2.0**-24
CPU = torch.device("cpu")


def ops():
    return torch.ops.verispec_cpu


def gguf_like(kind: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """Random codes with fp16 scales (and offsets), as a GGUF file holds them."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    if kind == "Q8_0":
        return QuantizedWeight(8, torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), d, None)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    offset = -8 * d if kind == "Q4_0" else (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    return QuantizedWeight(4, codes, d, offset)


def quantized_activations(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's x^ (float64) and each group's quantization step, computed as the kernel does."""
    m, k = x.shape
    b = x.float().view(m, k // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    if kind == "Q8_0":
        s = amax / 32767
        q = torch.where(s > 0, torch.round(b / torch.where(s > 0, s, 1)).clamp(-32767, 32767), 0)
        return (q.double() * s.double()).view(m, k), s[..., 0].double()
    s1 = amax / 127
    s = s1 / 254
    ok = s > 0
    q1 = torch.where(ok, torch.round(b / torch.where(ok, s1, 1)).clamp(-127, 127), 0)
    outlier = ok & (q1.pow(2).sum(-1, keepdim=True) < 2 * 127**2)  # max|x| > 4 rms, on the int8 values
    residual = (b.double() - q1.double() * s1.double()).float()  # exact product: one rounding, as fma
    q2 = torch.where(outlier, torch.round(residual / torch.where(ok, s, 1)).clamp(-127, 127), 0)
    xq = torch.where(outlier, (254 * q1.double() + q2.double()) * s.double(), q1.double() * s1.double())
    return xq.view(m, k), torch.where(outlier, s, s1)[..., 0].double()


def fp32_bound(xq: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The fp32 rounding bound: per group, d * sum, m * sum(x) and the running total each round
    once (relative 2^-24), and the total carries every earlier group's rounding."""
    groups = w.shape[1] // 32
    codes = w.codes.double().view(w.shape[0], groups, 32)
    if w.bits == 4 and not torch.equal(w.offset, -8 * w.scale):  # Q4_1: d q and m kept apart
        mags = (codes * w.scale.double()[..., None]).abs() + w.offset.double().abs()[..., None]
    else:
        mags = w.dequantize().double().abs().view(w.shape[0], groups, 32)
    return (groups + 3) * EPS32 * (xq.abs() @ mags.view(w.shape[0], -1).t())


def run(layer: PackedLinear, x: torch.Tensor, variant: str = "") -> torch.Tensor:
    return ops().packed_linear(x, layer.codes, layer.scales, layer.offsets, layer.format, layer.n, variant)


def test_this_cpu_runs_the_variants_its_build_has():
    variants = ops().packed_variants()
    assert variants[-1] == "portable"
    level = cpu_kernels.kernel_build().level
    expected = {"AVX512": {"avx512", "avx2"}, "AVX2": {"avx2"}, "DEFAULT": set()}[level]
    assert expected <= set(variants), (level, variants)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n, k", [(40, 64), (200, 576)])  # 40 and 200: not whole blocks of 16 columns
def test_every_variant_gives_the_portable_bits_within_the_fp32_bound(kind, n, k):
    w = gguf_like(kind, n, k, seed=n + k)
    layer = PackedLinear(w, CPU)
    assert layer.format == PACKED_FORMATS[kind]
    g = torch.Generator().manual_seed(7)
    for rows in (1, 2, 3, 8, 13):  # each tile shape's chains; 13: a full tile and a partial one
        x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16()
        base = run(layer, x, "portable")
        for variant in ops().packed_variants():
            assert torch.equal(run(layer, x, variant).view(torch.int16), base.view(torch.int16)), variant
        xq, _ = quantized_activations(x, kind)
        y = run(layer, x.float(), "portable").double()  # fp32 output: the kernel's own sums
        err = (y - xq @ w.dequantize().double().t()).abs()
        assert (err <= fp32_bound(xq, w)).all(), float((err / fp32_bound(xq, w)).max())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_activations_cost_at_most_half_a_step(kind):
    """Against the product with x itself: each group adds at most (step / 2) * sum |w| over it, the
    step being int8's in plain groups and the residual's (about int16's) in outlier groups."""
    w = gguf_like(kind, 96, 256, seed=3)
    layer = PackedLinear(w, CPU)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)) * 3
    x[:, :128:37] = 60.0  # a spike in each of groups 0 to 3 (rms about 3): outlier groups beside plain ones
    xq, step = quantized_activations(x, kind)
    if kind != "Q8_0":
        amax = x.float().view(5, 8, 32).abs().amax(-1).double()
        fine = step * 1000 < amax  # the residual's step: max|x| / 32258, against int8's max|x| / 127
        assert fine[:, :4].all() and not fine[:, 4:].any()
    wd = w.dequantize().double()
    quant = (step / 2 * (1 + 2.0**-10)) @ wd.abs().view(96, 8, 32).sum(-1).t()  # [rows, n]
    err = (run(layer, x).double() - x.double() @ wd.t()).abs()
    assert (err <= quant + fp32_bound(xq, w)).all()
    rel = float((err.max() / (x.double().abs() @ wd.abs().t()).max()))
    assert rel < (2.0**-14 if kind == "Q8_0" else 2.0**-8)  # int16: 15 bits; int8: 7 bits, finer than bf16's 8


def test_a_row_does_not_depend_on_the_rows_beside_it():
    w = gguf_like("Q4_1", 64, 128, seed=5)
    layer = PackedLinear(w, CPU)
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    together = run(layer, x)
    for i in (0, 7, 8, 16):
        for lo in {0, i - i % 3}:
            alone = run(layer, x[lo : i + 1])[-1]
            assert torch.equal(alone.view(torch.int16), together[i].view(torch.int16))


def test_a_non_finite_row_gives_nan_and_leaves_the_others():
    w = gguf_like("Q8_0", 32, 64, seed=8)
    layer = PackedLinear(w, CPU)
    x = torch.randn(3, 64)
    clean = run(layer, x)
    x[1, 5] = float("inf")
    y = run(layer, x)
    assert torch.isnan(y[1]).all() and torch.equal(y[0], clean[0]) and torch.equal(y[2], clean[2])
    assert run(layer, x[:0]).shape == (0, 32)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_packed_blocks_decode_to_the_files_values_exactly(kind):
    w = gguf_like(kind, 50, 96, seed=9)
    layer = PackedLinear(w, CPU)
    dense = ops().packed_dequantize(layer.codes, layer.scales, layer.offsets, layer.format, 50, torch.float32)
    assert torch.equal(dense, w.dequantize())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_blocks_decode_straight_to_half_precision_as_the_exact_matrix_rounded_once(kind, dtype):
    w = gguf_like(kind, 37, 96, seed=12)  # 37 columns: the last block of 16 is partly padding
    layer = PackedLinear(w, CPU)
    half = ops().packed_dequantize(layer.codes, layer.scales, layer.offsets, layer.format, 37, dtype)
    assert half.dtype == dtype and torch.equal(half, w.dequantize().to(dtype))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_long_call_gives_every_row_the_bits_it_has_alone(kind):
    """Prefill chunks of any length run on the kernel, in panels of rows: a row's bits are the
    same alone, in a short batch or in a call of 300 rows (three panels), so the fast tier is
    batch-invariant."""
    layer = PackedLinear(gguf_like(kind, 40, 128, seed=13), CPU)
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(14)).bfloat16()
    long = run(layer, x)
    for rows in ([0], [127, 128, 129], list(range(250, 300)), [5, 299]):
        assert torch.equal(run(layer, x[rows]).view(torch.int16), long[rows].view(torch.int16)), rows


def test_the_lm_head_returns_fp32_logits():
    w = gguf_like("Q8_0", 48, 64, seed=12)
    head = make_linear(w, torch.bfloat16, CPU, head=True)
    assert isinstance(head, PackedLinear) and head.float_output
    x = torch.randn(2, 64).bfloat16()
    assert head(x).dtype == torch.float32 and torch.equal(head(x), run(head, x.float()))
    many = torch.randn(300, 64).bfloat16()  # any number of rows on the kernel: row-invariant logits
    assert torch.equal(head(many)[-2:], head(many[-2:]))


def test_the_fast_tier_packs_every_gguf_format_and_round_to_nearest():
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        assert isinstance(make_linear(gguf_like(kind, 32, 64), torch.bfloat16, CPU), PackedLinear)
    rtn = quantize_rtn(torch.randn(32, 64), 4)  # fp16 scales and offsets, as a file's
    assert packed_format(rtn) == PACKED_FORMATS["Q4_1"]
    fp32_offsets = QuantizedWeight(4, rtn.codes, rtn.scale, rtn.offset + 1e-7)
    assert packed_format(fp32_offsets) is None  # not exact in fp16: torch's int4 kernel instead
    assert isinstance(make_linear(fp32_offsets, torch.bfloat16, CPU), QuantLinear)
    odd_groups = QuantizedWeight(4, rtn.codes, rtn.scale.repeat_interleave(2, 1)[:, ::2], rtn.offset, 64)
    assert packed_format(odd_groups) is None


def test_bad_operands_are_refused_with_the_reason():
    layer = PackedLinear(gguf_like("Q4_1", 32, 64), CPU)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops().packed_linear(torch.randn(1, 48), layer.codes, layer.scales, layer.offsets, layer.format, 32)
    with pytest.raises(RuntimeError, match="offsets are given for Q4_1, Q5_1, Q4_K and Q5_K only"):
        ops().packed_linear(torch.randn(1, 64), layer.codes, layer.scales, None, layer.format, 32)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops().packed_linear(torch.randn(1, 64), layer.codes, layer.scales, layer.offsets, layer.format, 64)
    with pytest.raises(ValueError, match="no variant"):
        ops().packed_linear(torch.randn(1, 64), layer.codes, layer.scales, layer.offsets, layer.format, 32, "sse9")


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), n=st.integers(1, 70), groups=st.integers(1, 6),
       rows=st.integers(1, 12), seed=st.integers(0, 2**16), spread=st.floats(-20, 20))
def test_any_shape_and_magnitude_stays_within_the_bound(kind, n, groups, rows, seed, spread):
    k = 32 * groups
    w = gguf_like(kind, n, k, seed)
    layer = PackedLinear(w, CPU)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, k, generator=g) * math.exp(spread) * (torch.rand(rows, k, generator=g) < 0.9)
    xq, _ = quantized_activations(x, kind)
    err = (run(layer, x).double() - xq @ w.dequantize().double().t()).abs()
    assert (err <= fp32_bound(xq, w) + 1e-300).all()
    assert torch.equal(run(layer, x[-1:])[0], run(layer, x)[-1])
