"""A GGUF file's blocks kept as the file stores them (`verispec.models.gguf_blocks`), for every type
the packed kernel keeps: decoded bit for bit as gguf's own `dequantize` decodes them (the exact
tier on the codes, and the packed layout's reference decode), hypothesis over random blocks; the
packed kernel on Q5_0, Q5_1, Q4_K, Q5_K and Q6_K within its arithmetic's bound of the float64
product, every instruction-set variant giving the portable variant's bits, rows independent of
the rows beside them; mixed formats stacked along N; shards by whole blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_packed_linear import EPS32, quantized_activations
from verispec.models import cpu_kernels
from verispec.models.gguf_blocks import BLOCKS, PACKED_KINDS, GGUFBlocks, Stacked, columns, concat_rows
from verispec.models.linear import DecodedLinear, PackedLinear, StackedLinear, make_linear

pytestmark = [pytest.mark.skipif(not cpu_kernels.kernels_wanted(),
                                 reason="verispec's CPU kernels are off here (no C++ compiler, or VERISPEC_CPU_KERNELS=0)"),
              pytest.mark.usefixtures("cpu_kernels_loaded")]
CPU = torch.device("cpu")
NEW_KINDS = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# Where each type's fp16 scales lie in its block (d, and m / dmin).
_HALVES = {"Q4_0": (0,), "Q8_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, n: int, k: int, seed: int = 0, exponent: float = -2.0) -> np.ndarray:
    """[n, row bytes] of random blocks: every byte random (codes, high bits, packed sub-block
    scales) except the fp16 scales, finite and about 10^exponent."""
    rng = np.random.default_rng(seed)
    inputs, size = BLOCKS[kind]
    blocks = rng.integers(0, 256, (n * k // inputs, size), dtype=np.uint8)
    for at in _HALVES[kind]:
        scale = (rng.standard_normal(len(blocks)) * 10.0 ** (exponent + rng.uniform(-1, 1, len(blocks))))
        blocks[:, at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def gguf_dequantize(raw: np.ndarray, kind: str, shape) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw.reshape(-1), GGMLQuantizationType[kind]).reshape(shape).astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(PACKED_KINDS), seed=st.integers(0, 2**32 - 1), exponent=st.floats(-6, 2),
       rows=st.integers(1, 37))
def test_blocks_decode_bit_for_bit_as_gguf(kind, seed, exponent, rows):
    k = BLOCKS[kind][0] * 2
    raw = random_blocks(kind, rows, k, seed, exponent)
    want = gguf_dequantize(raw, kind, (rows, k))
    blocks = GGUFBlocks.of(raw, kind, (rows, k))
    assert np.array_equal(blocks.dequantize().numpy(), want)  # the exact tier's codes and scales
    codes, scales, offsets, fmt = blocks.packed()
    dense = torch.ops.verispec_cpu.packed_dequantize(codes, scales, offsets, fmt, rows, torch.float32)
    assert np.array_equal(dense.numpy(), want)  # the packed layout holds the same values


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_the_exact_tier_on_the_codes_decodes_gguf_values(kind):
    """DecodedLinear decodes each weight inside its matmul to gguf's fp32 value: on the identity
    (each row one input) its output is the matrix itself, bit for bit."""
    n, k = 40, 512
    raw = random_blocks(kind, n, k, seed=3)
    exact = make_linear(GGUFBlocks.of(raw, kind, (n, k)), torch.float32, CPU)
    assert isinstance(exact, DecodedLinear)
    assert np.array_equal(exact(torch.eye(k)).t().numpy(), gguf_dequantize(raw, kind, (n, k)))


def bound(xq: torch.Tensor, blocks: GGUFBlocks) -> torch.Tensor:
    """The packed kernel's fp32 rounding bound: per group the scaled sum, the offset's term and the
    running total round once each, and so may the int32 sum's conversion (wide codes)."""
    q = blocks.decoded()
    n, k = q.shape
    groups, g = k // 32, q.group_size
    scale = q.scale.double().repeat_interleave(g, 1)
    mags = (q.codes.double() * scale).abs()
    if q.offset is not None:
        mags = mags + q.offset.double().abs().repeat_interleave(g, 1)
    return (groups + 4) * 2 * EPS32 * (xq.abs() @ mags.t())


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_packed_kernel_on_the_new_formats(kind):
    n, k = 40, 768
    blocks = GGUFBlocks.of(random_blocks(kind, n, k, seed=5), kind, (n, k))
    layer = PackedLinear(blocks, CPU)
    x = torch.randn(11, k)
    x[0, 7] = 50.0  # an outlier group: the int8 residual's path
    x[3, 40:72] = 0.0  # an all-zero group
    y = layer(x)
    xq, _ = quantized_activations(x, kind)
    want = xq @ blocks.dequantize().double().t()
    assert ((y.double() - want).abs() <= bound(xq, blocks)).all()
    for variant in torch.ops.verispec_cpu.packed_variants():  # every instruction set: the same bits
        ref = torch.ops.verispec_cpu.packed_linear(x, layer.codes, layer.scales, layer.offsets, layer.format, n,
                                                   variant)
        assert torch.equal(ref, y), variant
    for r in range(x.shape[0]):  # a row's bits do not depend on the rows beside it
        assert torch.equal(layer(x[r : r + 1]), y[r : r + 1])
    assert torch.equal(layer(x.bfloat16()), torch.ops.verispec_cpu.packed_linear(
        x.bfloat16(), layer.codes, layer.scales, layer.offsets, layer.format, n, "portable"))


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_packed_bytes_are_the_files(kind):
    """Nothing widened: the packed layout is the file's size, up to the 16-row blocks' padding
    and the 6-bit scales of K-quants stored a byte each."""
    n, k = 64, 1024
    raw = random_blocks(kind, n, k)
    codes, scales, offsets, _ = GGUFBlocks.of(raw, kind, (n, k)).packed()
    packed = codes.nbytes + scales.nbytes + (0 if offsets is None else offsets.nbytes)
    assert raw.nbytes <= packed <= 1.03 * raw.nbytes


def test_mixed_formats_stack_side_by_side():
    """q|k in Q4_K beside v in Q6_K (llama.cpp's Q4_K_M): each part on its own kernel."""
    k = 512
    q, kk, v = (GGUFBlocks.of(random_blocks(kind, n, k, seed=i), kind, (n, k))
                for i, (kind, n) in enumerate([("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)]))
    same = concat_rows([q, kk])
    assert isinstance(same, GGUFBlocks) and same.shape == (96, k) and same.kind == "Q4_K"
    mixed = concat_rows([q, kk, v])
    assert isinstance(mixed, Stacked) and mixed.shape == (128, k)
    layer = make_linear(mixed, torch.bfloat16, CPU)
    assert isinstance(layer, StackedLinear)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    parts = [PackedLinear(p, CPU)(x) for p in (same, v)]
    assert torch.equal(layer(x), torch.cat(parts, -1))
    exact = make_linear(mixed, torch.float32, CPU)  # the exact tier: the decoded parts side by side
    want = torch.cat([DecodedLinear(p.decoded(), CPU)(x.float()) for p in (q, kk, v)], -1)
    assert torch.equal(exact(x.float()), want)


@pytest.mark.parametrize("kind, lo, hi, form", [("Q4_K", 256, 768, GGUFBlocks), ("Q4_K", 32, 96, "codes"),
                                                ("Q5_0", 64, 160, GGUFBlocks), ("Q4_K", 8, 40, torch.Tensor)])
def test_column_shards(kind, lo, hi, form):
    """A row-parallel shard: whole blocks stay blocks, a cut inside one takes the codes, a cut
    inside a group the dense values; each is exactly those columns."""
    blocks = GGUFBlocks.of(random_blocks(kind, 16, 1024), kind, (16, 1024))
    part = columns(blocks, lo, hi)
    if form == "codes":
        assert part.codes.shape == (16, hi - lo)
    else:
        assert isinstance(part, form)
    values = part if isinstance(part, torch.Tensor) else part.dequantize()
    assert torch.equal(values, blocks.dequantize()[:, lo:hi])


def test_rows_are_read_from_the_file_when_needed(tmp_path):
    raw = random_blocks("Q6_K", 8, 256)
    path = tmp_path / "blocks.bin"
    path.write_bytes(b"header" + raw.tobytes())
    blocks = GGUFBlocks.from_file(path, 6, "Q6_K", (8, 256))
    swapped = blocks.map_rows(lambda t: t.flip(0))
    assert swapped.shape == (8, 256)
    assert torch.equal(swapped.dequantize(), blocks.dequantize().flip(0))
    with pytest.raises(ValueError, match="truncated"):
        GGUFBlocks.from_file(path, 100, "Q6_K", (8, 256)).raw()


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_a_weight_update_requantizes_to_the_files_type(kind):
    """New values (a trainer's update) go back into the type the matrix was loaded in, and pack
    into buffers of the same shapes, so the update writes into the model's tensors in place."""
    from verispec.models.gguf_blocks import requantize

    n, k = 32, 512
    like = GGUFBlocks.of(random_blocks(kind, n, k), kind, (n, k))
    values = torch.randn(n, k) * 0.02
    new = requantize(values, like)
    assert new.kind == kind
    old_layer, new_layer = PackedLinear(like, CPU), PackedLinear(new, CPU)
    for name, buf in old_layer.named_buffers():
        assert getattr(new_layer, name).shape == buf.shape, name
    err = (new.dequantize() - values).abs().max() / values.abs().max()
    assert err < {"Q4_0": 0.15, "Q4_K": 0.15}.get(kind, 0.08)


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_rows_of_a_packed_matrix_are_its_exact_values(kind):
    """A tied embedding's lookup reads the packed head's rows: each value exactly gguf's, rounded
    once to the activations' dtype."""
    n, k = 40, 512
    raw = random_blocks(kind, n, k, seed=9)
    layer = PackedLinear(GGUFBlocks.of(raw, kind, (n, k)), CPU)
    ids = torch.tensor([0, 39, 17, 17, 5])
    want = torch.from_numpy(gguf_dequantize(raw, kind, (n, k)))[ids]
    assert torch.equal(layer.rows(ids, torch.float32), want)
    assert torch.equal(layer.rows(ids, torch.bfloat16), want.bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        layer.rows(torch.tensor([40]), torch.float32)


def test_a_tied_packed_head_serves_the_lookup_without_a_dense_table(smollm2_path):
    from verispec.models.llama import LlamaModel
    from verispec.models.loader import load_checkpoint

    cfg, weights = load_checkpoint(smollm2_path, torch.bfloat16, "gguf")
    model = LlamaModel(cfg, weights, num_layers=1)
    assert model.embed.numel() == 0 and isinstance(model.lm_head, PackedLinear)
    ids = torch.tensor([1, 2, 49151])
    assert torch.equal(model.embed_tokens(ids), weights["embed"].dequantize()[ids].bfloat16())


@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("seed", range(3))
def test_iq4_types_widen_to_their_exact_values(kind, seed, tmp_path):
    """IQ4_NL / IQ4_XS: each weight a table value times its group's scale, as 8-bit codes and fp32
    scales that decode bit for bit as gguf's dequantize does, on random blocks (scales 1e-4..1e2)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from verispec.models.gguf_blocks import widened

    rng = np.random.default_rng(seed)
    inputs, size = {"IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}[kind]
    n, k = 5, 512
    blocks = rng.integers(0, 256, (n * k // inputs, size), dtype=np.uint8)
    blocks[:, 0:2] = (rng.uniform(1e-4, 1e2, (len(blocks), 1)) * rng.choice([-1, 1], (len(blocks), 1))
                      ).astype(np.float16).view(np.uint8)
    w = widened(blocks.reshape(-1), kind, (n, k))
    ref = dequantize(blocks.reshape(n, -1), GGMLQuantizationType[kind]).reshape(n, k)
    assert w.bits == 8 and w.exact_source and w.source == kind
    assert np.array_equal(w.dequantize().numpy().view(np.uint32), np.asarray(ref, dtype=np.float32).view(np.uint32))
    assert widened(blocks.reshape(-1), "Q3_K", (n, k)) is None
