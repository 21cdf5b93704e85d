"""verispec.models.kquants: numpy K-quant blocks that gguf's own decoder reads back.

gguf-py decodes Q4_K/Q5_K/Q6_K but cannot encode them, so its `dequantize` is the oracle for the
byte layout, and the error bounds below follow from the formats:
- Q4_K/Q5_K sub-blocks of 32: w = d*sc*q - dmin*m, q in 0..nmax (15, 31), 6-bit sc and m;
- Q6_K sub-blocks of 16: w = d*sc*(q - 32), q - 32 in -32..31, int8 sc.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize
from hypothesis import given, settings, strategies as st

from verispec.models.kquants import QK_K, TYPE_SIZE, quantize_k

KINDS = ("Q4_K", "Q5_K", "Q6_K")
NMAX = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 32}
SUB = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16}  # weights per sub-block
# fp16's smallest subnormal: the granularity of d (and dmin) for the tiniest weights
FP16_TINY = 2.0**-24


def decode(raw: np.ndarray, kind: str, shape) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType[kind]).reshape(shape)


def rel_rms(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2)))


def assert_within_step(x: np.ndarray, y: np.ndarray, kind: str) -> None:
    """Every sub-block's max |error| is at most one code step of its own range plus what the
    super-block's 6-bit (8-bit for Q6_K) scale quantization and fp16 d may add:
    step/2 from rounding the codes, up to step/2 where the searched scale clips the extreme
    weights, up to nmax * d/2 + dmin/2 from the 6-bit scales and mins (d about range/nmax/63, dmin
    |min|/63; Q6_K: 32 * d/2 with d = amax/32/128), a little more for fp16's rounding of d."""
    sub, nmax = SUB[kind], NMAX[kind]
    xs = x.reshape(x.shape[0], -1, QK_K // sub, sub)
    err = np.abs(y - x).reshape(xs.shape).max(-1)
    if kind == "Q6_K":
        step = np.abs(xs).max(-1) / nmax
        scales = np.abs(xs).max((-1, -2), keepdims=True)[..., 0] / 128
    else:
        step = (xs.max(-1) - np.minimum(xs.min(-1), 0)) / nmax
        block = x.reshape(x.shape[0], -1, QK_K)
        lo = np.minimum(block.min(-1), 0)
        scales = (block.max(-1) - 2 * lo)[..., None] / 63  # (range + |min|) / 63
    bound = step + scales + 2 * nmax * FP16_TINY
    assert (err <= bound * (1 + 1e-5)).all(), float((err / bound).max())


# ----------------------------------------------------------------------- the plain baseline
def fp16_scale(top: np.ndarray, levels: int) -> np.ndarray:
    """The fp16 super-block scale for sub-block scales up to |top|: the nearest fp16 of
    top/levels, or the next one up where rounding down would push the top code past levels
    (fp16's subnormals), as float32."""
    want = np.abs(top) / levels
    h = want.astype(np.float16)
    up = h.astype(np.float64) * (levels + 0.5) < want * levels
    h[up] = np.nextafter(h[up], np.float16(np.inf))
    return h.astype(np.float32)


def integer_scales(scale: np.ndarray, d: np.ndarray, lo: int, hi: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.clip(np.nan_to_num(np.rint(scale / d)), lo, hi).astype(np.float32)


def plain_k(x: np.ndarray, kind: str) -> np.ndarray:
    """Decoded plain round-to-nearest of [B, 256] blocks: each sub-block's min..max (Q4_K/Q5_K)
    or absmax (Q6_K) onto the codes; its scale (and min) to 6 bits (Q6_K: 8) against an fp16
    super-block scale; the codes rounded under those."""
    sub, nmax = SUB[kind], NMAX[kind]
    xs = x.reshape(x.shape[0], -1, sub).astype(np.float64)
    if kind == "Q6_K":
        big = np.take_along_axis(xs, np.abs(xs).argmax(-1)[..., None], -1)[..., 0]
        scale = -big / nmax
        top = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)
        d = fp16_scale(top, 128) * -np.sign(top)  # the largest |scale| onto -128
        step = d * integer_scales(scale, d, -128, 127)
        q = integer_scales(xs, step[..., None], -32, 31)
        return (step[..., None] * q).reshape(x.shape)
    lo = np.minimum(xs.min(-1), 0)
    scale, the_min = (xs.max(-1) - lo) / nmax, -lo
    d = fp16_scale(scale.max(-1, keepdims=True), 63)
    dmin = fp16_scale(the_min.max(-1, keepdims=True), 63)
    step, offset = d * integer_scales(scale, d, 0, 63), dmin * integer_scales(the_min, dmin, 0, 63)
    q = integer_scales(xs + offset[..., None], step[..., None], 0, nmax)
    return (step[..., None] * q - offset[..., None]).reshape(x.shape)


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("kind, bound", [("Q4_K", 0.075), ("Q5_K", 0.038), ("Q6_K", 0.019)])
def test_round_trip_gaussian(kind, bound):
    # llama.cpp's reference quantizer reaches 0.0714, 0.0361, 0.0177 on this data
    x = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    raw = quantize_k(x, kind)
    assert raw.dtype == np.uint8 and raw.shape == (64, 1024 // QK_K * TYPE_SIZE[kind])
    y = decode(raw, kind, x.shape)
    assert rel_rms(y, x) < bound
    assert_within_step(x, y, kind)
    # never worse than plain round-to-nearest, on the whole and block by block
    base = plain_k(x.reshape(-1, QK_K), kind).reshape(x.shape)
    assert rel_rms(y, x) < rel_rms(base, x)


def _blocks(seed: int, kinds: list[int], exponent: float) -> np.ndarray:
    """Blocks of several shapes of data: gaussian, heavy-tailed, all positive, sparse outliers,
    zeros, a constant, a lone spike, few distinct values."""
    rng = np.random.default_rng(seed)
    out = []
    for k in kinds:
        g = rng.standard_normal(QK_K)
        out.append([g, rng.standard_t(1, QK_K), rng.uniform(0.5, 1, QK_K) * (1 + 3 * (g > 2)),
                    np.where(rng.random(QK_K) < 0.03, 50 * g, 0.01 * g), np.zeros(QK_K),
                    np.full(QK_K, g[0]), np.eye(1, QK_K, int(rng.integers(QK_K)))[0] * g[1],
                    np.round(g * 2)][k])
    x = np.stack(out) * 10.0**exponent
    return np.clip(x, -65504, 65504).astype(np.float32)


@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), kinds=st.lists(st.integers(0, 7), min_size=1, max_size=6),
       exponent=st.floats(-6, 4.5), kind=st.sampled_from(KINDS))
def test_random_blocks(seed, kinds, exponent, kind):
    x = _blocks(seed, kinds, exponent)
    if len(kinds) % 2 == 0:
        x = x.reshape(-1, 2 * QK_K)  # rows of two blocks
    raw = quantize_k(x, kind)
    assert raw.shape == (x.shape[0], x.shape[1] // QK_K * TYPE_SIZE[kind])
    y = decode(raw, kind, x.shape)
    assert np.isfinite(y).all()
    assert_within_step(x, y, kind)
    if kind == "Q6_K":  # no offset: zeros stay exact zeros
        assert (y[x == 0] == 0).all()
    # per 256-block, no worse than plain round-to-nearest (up to fp32 rounding of the sums)
    blocks, got = x.reshape(-1, QK_K), y.reshape(-1, QK_K)
    base = plain_k(blocks, kind)
    err, base_err = np.square(got - blocks).sum(1), np.square(base - blocks).sum(1)
    assert (err <= base_err * (1 + 1e-4) + 1e-30).all()


@pytest.mark.parametrize("value", [0.0, 1.0, -3.5, 65504.0, -65504.0, 1e-7])
@pytest.mark.parametrize("kind", KINDS)
def test_constant_blocks(kind, value):
    x = np.full((2, 512), value, np.float32)
    y = decode(quantize_k(x, kind), kind, x.shape)
    assert np.isfinite(y).all()
    # a constant is a sub-block's extreme: it is met up to the 6-bit scales' and fp16's rounding
    assert np.abs(y - x).max() <= abs(value) * 2**-10 + FP16_TINY * 64


def _grid_q4_q5(rng, kind, blocks):
    """Values exactly on the Q4_K/Q5_K grid: each sub-block with a code 0 and a code nmax and some
    sc and some m at 63, so the plain fit's d, dmin, sc, m are the ones they were built from."""
    nmax = NMAX[kind]
    d = np.float16(2.0 ** rng.uniform(-12, -2, (blocks, 1))).astype(np.float32)
    dmin = np.float16(2.0 ** rng.uniform(-12, -2, (blocks, 1))).astype(np.float32)
    sc = rng.integers(1, 64, (blocks, 8)).astype(np.uint8)
    m = rng.integers(0, 64, (blocks, 8)).astype(np.uint8)
    sc[:, 0], m[:, 1] = 63, 63
    q = rng.integers(0, nmax + 1, (blocks, 8, 32))
    q[..., 0], q[..., 1] = 0, nmax
    values = (d * sc)[..., None] * q.astype(np.float32) - (dmin * m)[..., None]
    return values.reshape(blocks, QK_K).astype(np.float32), d, dmin, sc, m


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_exact_grid_round_trips_q4_q5(kind):
    x, d, dmin, sc, m = _grid_q4_q5(np.random.default_rng(1), kind, 16)
    raw = quantize_k(x, kind)
    assert np.array_equal(decode(raw, kind, x.shape), x)
    # the header is where ggml keeps it: fp16 d, fp16 dmin, then 12 bytes of 6-bit scales and mins
    assert np.array_equal(raw[:, 0:2].copy().view(np.float16).astype(np.float32), d)
    assert np.array_equal(raw[:, 2:4].copy().view(np.float16).astype(np.float32), dmin)
    got_sc, got_m = Q4_K.get_scale_min(raw[:, 4:16].copy())
    assert np.array_equal(got_sc, sc) and np.array_equal(got_m, m)


def test_exact_grid_round_trips_q6():
    rng = np.random.default_rng(2)
    blocks = 16
    d = np.float16(2.0 ** rng.uniform(-14, -4, (blocks, 1))).astype(np.float32)
    sc = rng.integers(-128, 128, (blocks, 16)).astype(np.int8)
    sc[:, 3], sc[:, 5] = -128, 0  # the largest |scale| is what d was made from; a zero sub-block
    q = rng.integers(0, 64, (blocks, 16, 16))
    q[..., 7] = 0  # code -32: each sub-block's largest |value|, which sets its scale
    q[sc == 0] = 32  # zero sub-blocks: code 32 is 0
    x = ((d * sc.astype(np.float32))[..., None] * (q - 32).astype(np.float32)).reshape(blocks, QK_K)
    raw = quantize_k(x, "Q6_K")
    assert np.array_equal(decode(raw, "Q6_K", x.shape), x)
    # layout: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
    assert np.array_equal(raw[:, 192:208].view(np.int8), sc)
    assert np.array_equal(raw[:, 208:210].copy().view(np.float16).astype(np.float32), d)
    ql, qh = raw[:, :128].reshape(blocks, 2, 64), raw[:, 128:192].reshape(blocks, 2, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # weights 0..127 of each half
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    assert np.array_equal((low | high << 4).reshape(blocks, 16, 16), q)


def test_many_rows_in_slices():
    # more blocks than one slice, and rows of several blocks: rows stay in order
    x = np.random.default_rng(3).standard_normal((40, 256 * 30)).astype(np.float32)
    x[7] *= 100
    x[11] = 0
    for kind in KINDS:
        raw = quantize_k(x, kind)
        assert np.array_equal(quantize_k(x[7:8], kind), raw[7:8])
        y = decode(raw, kind, x.shape)
        assert_within_step(x, y, kind)
        assert (y[11] == 0).all()


def test_accepts_other_float_dtypes_and_views():
    x = np.random.default_rng(4).standard_normal((4, 1024))
    for kind in KINDS:
        want = quantize_k(x.astype(np.float32), kind)
        assert np.array_equal(quantize_k(x, kind), want)  # float64 in
        assert np.array_equal(quantize_k(np.asfortranarray(x.astype(np.float32)), kind), want)
    assert quantize_k(np.zeros((0, 512), np.float32), "Q6_K").shape == (0, 2 * TYPE_SIZE["Q6_K"])


def test_bad_input():
    x = np.zeros((2, 512), np.float32)
    with pytest.raises(ValueError, match=r"Q4_K, Q5_K, Q6_K.*'Q3_K'"):
        quantize_k(x, "Q3_K")
    with pytest.raises(ValueError, match=r"K=300 is not a multiple of 256"):
        quantize_k(np.zeros((2, 300), np.float32), "Q4_K")
    with pytest.raises(ValueError, match=r"2-D"):
        quantize_k(np.zeros(512, np.float32), "Q5_K")
    bad = x.copy()
    bad[1, 5] = np.nan
    with pytest.raises(ValueError, match=r"finite"):
        quantize_k(bad, "Q6_K")
