"""verispec's own numpy quantizer for GGUF's K-quant blocks: Q4_K, Q5_K and Q6_K.

gguf-py decodes every GGML type but encodes only the 32-weight block types (Q4_0 .. Q8_0). This
module writes the 256-weight super-blocks byte for byte as ggml lays them out (block_q4_K,
block_q5_K, block_q6_K in ggml-common.h), so `gguf.quants.dequantize` and llama.cpp read them.
verispec uses it to re-quantize updated weights into a file's own K-quant type and to write
K-quant GGUF files for tests and benchmarks (benchmarks/ggufs.py).

The formats (a weight is w):
- Q4_K / Q5_K: 8 sub-blocks of 32, w = d*sc*q - dmin*m, q 4 or 5 bits, sc and m 6 bits each,
  d and dmin fp16 per super-block.
- Q6_K: 16 sub-blocks of 16, w = d*sc*(q - 32), q 6 bits, sc int8, d fp16.

The algorithms are llama.cpp's reference quantizers (ggml-quants.c: make_qkx2_quants for Q4_K
and Q5_K, make_qx_quants for Q6_K), re-derived to run on whole arrays of sub-blocks at once:
each candidate grid spacing is tried on every sub-block in one pass, and a fit is scored from
weighted sums (no per-candidate second pass). Three deliberate differences, all for accuracy:
- each sub-block is first divided by its largest |value|, so the search's weighted sums neither
  overflow nor underflow float32 whatever the magnitude (the search itself is scale-free);
- the 6/8-bit sub-block scales are rounded against the fp16 d the decoder multiplies (the
  reference divides by the unrounded d); d never rounds to 0 for tiny weights and saturates at
  fp16's largest value for huge ones (decoding clipped, never infinite);
- every super-block keeps whichever of the searched encoding and the plain one (min..max or
  absmax onto the codes, then the same 6/8-bit scale quantization) decodes closer to its input,
  so no block is ever worse than plain round-to-nearest.
On Gaussian weights the error matches the reference's (relative RMS 0.0714 Q4_K, 0.0361 Q5_K,
0.0177 Q6_K), and is lower for tiny weights (whose d is an fp16 subnormal); one core encodes
10M weights in about 1.2 s (Q4_K), 0.8 s (Q5_K), 0.5 s (Q6_K).
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per super-block
TYPE_SIZE = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block
# Super-blocks per slice: 256k values, float32 temporaries of 1 MB that stay near the core's cache
# through the ~20 candidate passes of the search (measured: 4x larger slices ran 10-20% slower).
_SLICE = 1024
_FP16_MAX = 65504.0
_GROUP_MAX_EPS = 1e-15  # ggml's: a sub-block below this |max| is all zeros


def quantize_k(values: np.ndarray, kind: str) -> np.ndarray:
    """Quantize a float [N, K] matrix (K a multiple of 256) to GGUF `kind` blocks ("Q4_K", "Q5_K",
    "Q6_K"): uint8 [N, K // 256 * type_size], each row's blocks in order, as ggml writes them."""
    if kind not in TYPE_SIZE:
        raise ValueError(f"kind must be one of {', '.join(TYPE_SIZE)}; got {kind!r}")
    x = np.asarray(values)
    if x.ndim != 2:
        raise ValueError(f"values must be a 2-D [N, K] matrix; got shape {x.shape}")
    n, k = x.shape
    if k % QK_K:
        raise ValueError(f"row length K={k} is not a multiple of {QK_K}, the {kind} block size")
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], TYPE_SIZE[kind]), np.uint8)
    encode = _ENCODERS[kind]
    for start in range(0, blocks.shape[0], _SLICE):
        part = np.ascontiguousarray(blocks[start : start + _SLICE], dtype=np.float32)
        if not np.isfinite(part).all():
            raise ValueError(f"values must be finite; rows {start * QK_K // max(k, 1)}.. hold NaN or inf")
        out[start : start + part.shape[0]] = encode(part)
    return out.reshape(n, k // QK_K * TYPE_SIZE[kind])


# ----------------------------------------------------------------------------- Q4_K and Q5_K
def _encode_q4_k(x: np.ndarray) -> np.ndarray:
    # make_qkx2_quants(32, 15, ..., rmin=-1, rdelta=0.1, nstep=20) as quantize_row_q4_K_ref calls it
    return _pack_q4_k(*_encode_scale_min(x, nmax=15, rmin=-1.0, rdelta=0.1, nstep=20))


def _encode_q5_k(x: np.ndarray) -> np.ndarray:
    return _pack_q5_k(*_encode_scale_min(x, nmax=31, rmin=-0.5, rdelta=0.1, nstep=15))


def _encode_scale_min(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple:
    """(d, dmin, sc [B, 8], m [B, 8], codes [B, 256]) of [B, 256] blocks: the better per block of
    the searched and the plain min..max sub-block fits."""
    searched, plain = _search_scale_min(x.reshape(-1, 32), nmax, rmin, rdelta, nstep)
    a = _codes_scale_min(x, *searched, nmax)
    b = _codes_scale_min(x, *plain, nmax)
    return _keep_better(a, b)


def _search_scale_min(sub: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants for every [R, 32] sub-block at once: ((scale, min), (plain scale, min)),
    each [R] and >= 0, a value standing for scale*q - min.

    Candidate i: q = round((x - lo) * (nmax + rmin + rdelta*i) / (hi - lo)), then the weighted
    least-squares scale and offset of those codes, scored by the weighted squared error written
    out from the sums (w, w x, w x^2, w q, w q^2, w x q): a candidate costs a few passes over x.
    As in the reference, lo moves to the best offset so far, so later grids start from it."""
    amax = np.abs(sub).max(1)
    norm = np.where(amax > 0, amax, 1).astype(np.float32)
    x = sub / norm[:, None]
    lo = np.minimum(x.min(1), 0).astype(np.float64)  # the offset only ever subtracts (m >= 0)
    hi = x.max(1).astype(np.float64)
    # weights as the reference: the sub-block's rms plus |x|, favouring the large weights
    w = np.sqrt(np.mean(x * x, 1, keepdims=True)) + np.abs(x)
    wx = w * x
    sums = tuple(v.astype(np.float64) for v in (_rowsum(w), _rowsum(wx), _rowdot(wx, x)))
    bufs = (np.empty_like(x), np.empty_like(x))
    # the plain min..max grid is the reference's starting point and stays a candidate
    plain = (hi - lo) / nmax, lo
    best_err = _fit_error(*plain, *sums, *_weighted_code_sums(x, lo, _inverse(plain[0]), nmax, w, wx, bufs))
    best_s, best_m = plain
    for i in range(nstep + 1):
        iscale = (nmax + rmin + rdelta * i) * _inverse(hi - best_m)
        code_sums = _weighted_code_sums(x, best_m, iscale, nmax, w, wx, bufs)
        s, m, ok = _least_squares(*sums, *code_sums)
        err = _fit_error(s, m, *sums, *code_sums)
        better = ok & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        best_m = np.where(better, m, best_m)
    back = norm.astype(np.float64)
    return ((np.maximum(best_s, 0) * back, np.maximum(-best_m, 0) * back),
            (plain[0] * back, -plain[1] * back))


def _inverse(v: np.ndarray) -> np.ndarray:
    """1 / v where v > 0, else 0 (a flat sub-block: every code 0)."""
    return np.divide(1, v, out=np.zeros_like(v), where=v > 0)


def _least_squares(sw, sx, sxx, sl, sll, sxl):
    """(scale, offset, solvable) of the weighted fit x ~ scale*q + offset, offset <= 0."""
    det = sw * sll - sl * sl
    # codes that are (nearly) all equal leave the fit singular: not a candidate
    ok = det > 1e-5 * sw * sll
    det = np.where(ok, det, 1)
    s = (sw * sxl - sx * sl) / det
    m = (sll * sx - sl * sxl) / det
    positive = m > 0  # an offset above zero cannot be stored: refit the scale alone
    s = np.where(positive, sxl / np.where(sll > 0, sll, 1), s)
    return s, np.where(positive, 0, m), ok


def _weighted_code_sums(x, lo, iscale, nmax, w, wx, bufs):
    """(sum w q, sum w q^2, sum w x q) per sub-block, float64, of q = round((x - lo) * iscale)
    clamped to 0..nmax."""
    q, wq = bufs
    np.subtract(x, lo.astype(np.float32)[:, None], out=q)
    np.multiply(q, iscale.astype(np.float32)[:, None], out=q)
    np.rint(q, out=q)  # round half to even, as ggml's nearest_int
    np.clip(q, 0, nmax, out=q)
    np.multiply(q, w, out=wq)
    sl, sll, sxl = _rowsum(wq), _rowdot(wq, q), _rowdot(q, wx)
    return sl.astype(np.float64), sll.astype(np.float64), sxl.astype(np.float64)


def _rowsum(a: np.ndarray) -> np.ndarray:
    # einsum, not `a @ ones`: BLAS would spread a large gemv over threads, slower on a busy machine
    return np.einsum("ij->i", a)


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b)


def _fit_error(s, m, sw, sx, sxx, sl, sll, sxl):
    """sum w (s q + m - x)^2, expanded into the sums."""
    return sxx - 2 * s * sxl - 2 * m * sx + s * s * sll + 2 * s * m * sl + m * m * sw


def _codes_scale_min(x: np.ndarray, scale: np.ndarray, the_min: np.ndarray, nmax: int) -> tuple:
    """Quantize sub-block scales and mins to 6 bits under fp16 d and dmin, then the codes under
    those: (d, dmin, sc, m, codes, squared error per block)."""
    b = x.shape[0]
    d, sc = _super_scale(scale.reshape(b, 8), 63)
    dmin, m = _super_scale(the_min.reshape(b, 8), 63)
    step = d[:, None] * sc  # what the decoder multiplies: fp32 products of the stored values
    offset = dmin[:, None] * m
    inv = _inverse(step)
    xb = x.reshape(b, 8, 32)
    q = np.rint((xb + offset[..., None]) * inv[..., None])
    np.clip(q, 0, nmax, out=q)
    err = np.square(step[..., None] * q - offset[..., None] - xb).sum((1, 2))
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8).reshape(b, QK_K), err


def _super_scale(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(fp16-exact d [B], integer codes [B, n]) with d * code ~ values (>= 0) and codes <= levels."""
    d = _fp16(values.max(1) / levels, levels)
    codes = np.rint(np.divide(values, d[:, None], out=np.zeros_like(values), where=d[:, None] > 0))
    return d.astype(np.float32), np.clip(codes, 0, levels).astype(np.float32)


def _fp16(d: np.ndarray, levels: int) -> np.ndarray:
    """d (the super-block scale of codes up to `levels`) rounded to fp16, as float64.

    The nearest fp16, except where that is so far below |d| (fp16's subnormals, under 6e-5) that
    the largest scale's code would pass `levels`: there the next fp16 up, so tiny weights keep
    their scales instead of a d of 0. The magnitude saturates at fp16's largest, so weights past
    what the format can scale decode clipped, never infinite."""
    mag = np.minimum(np.abs(d), _FP16_MAX)
    h = mag.astype(np.float16)
    low = h.astype(np.float64) * (levels + 0.5) < mag * levels
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return np.copysign(h.astype(np.float64), d)


def _keep_better(a: tuple, b: tuple) -> tuple:
    """Field by field, the encoding of each block whose squared error (the last field) is lower."""
    take_a = a[-1] <= b[-1]
    return tuple(np.where(take_a.reshape(-1, *[1] * (fa.ndim - 1)), fa, fb) for fa, fb in zip(a[:-1], b[:-1]))


def _pack_scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of 6-bit (sc, m) pairs: sub-blocks 0-3 in the low 6 bits of bytes 0-7, 4-7 split
    into low nibbles (bytes 8-11) and top 2 bits (the high bits of bytes 0-7)."""
    return np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                           (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4], axis=1)


def _half_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[B, 256] 4-bit codes as 128 bytes: each 64 weights as 32 bytes, the first 32 in the low nibbles."""
    q = q.reshape(q.shape[0], 4, 2, 32) & 0xF
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(q.shape[0], 128)


def _pack_q4_k(d, dmin, sc, m, q) -> np.ndarray:
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), _pack_scales_k4(sc, m), _nibbles(q)], axis=1)


def _pack_q5_k(d, dmin, sc, m, q) -> np.ndarray:
    # qh: byte j holds the fifth bit of weight j of sub-block s in bit s
    high = (q.reshape(q.shape[0], 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[:, None]
    qh = np.bitwise_or.reduce(high, axis=1)
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), _pack_scales_k4(sc, m), qh, _nibbles(q)], axis=1)


# ------------------------------------------------------------------------------------- Q6_K
def _encode_q6_k(x: np.ndarray) -> np.ndarray:
    searched, plain = _search_scale_signed(x.reshape(-1, 16), nmax=32)
    return _pack_q6_k(*_keep_better(_codes_signed(x, searched), _codes_signed(x, plain)))


def _search_scale_signed(sub: np.ndarray, nmax: int, steps: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(16, 32, ..., rmse_type=1) for every [R, 16] sub-block at once: (searched
    scale, plain absmax scale), each [R], signed, a value standing for scale * q, q in -nmax..nmax-1.

    Dividing each sub-block by its largest-magnitude value (signed) makes that value 1, so the
    reference's iscale -(nmax + 0.1 i) / max is one number for all sub-blocks. Candidates are
    scored as the reference does: the x^2-weighted fit explains sum(w x q)^2 / sum(w q^2)."""
    rows = np.arange(sub.shape[0])
    big = sub[rows, np.abs(sub).argmax(1)]  # the first largest |x|, as the reference picks it
    zero = np.abs(big) < _GROUP_MAX_EPS
    norm = np.where(zero, 1, big).astype(np.float32)
    x = sub / norm[:, None]
    x2 = x * x
    x3 = x2 * x
    q = np.empty_like(x)
    best_s = best = None
    for f in [nmax] + [nmax + 0.1 * i for i in range(-steps, steps + 1) if i]:
        np.multiply(x, np.float32(-f), out=q)
        np.rint(q, out=q)
        np.clip(q, -nmax, nmax - 1, out=q)
        slx = _rowdot(q, x3).astype(np.float64)
        np.multiply(q, q, out=q)
        sl2 = _rowdot(q, x2).astype(np.float64)
        s = slx / np.where(sl2 > 0, sl2, 1)
        if best is None:
            best_s, best = s, s * slx
            continue
        better = (sl2 > 0) & (slx * slx > best * sl2)
        best_s = np.where(better, s, best_s)
        best = np.where(better, s * slx, best)
    back = np.where(zero, 0, norm).astype(np.float64)
    return best_s * back, np.full(sub.shape[0], -1.0 / nmax) * back


def _codes_signed(x: np.ndarray, scale: np.ndarray) -> tuple:
    """Quantize the 16 sub-block scales to int8 under an fp16 d (the largest-magnitude scale onto
    -128, as the reference), then the codes: (d, sc, codes 0..63, squared error per block)."""
    b = x.shape[0]
    scale = scale.reshape(b, 16)
    top = scale[np.arange(b), np.abs(scale).argmax(1)]
    d = _fp16(top / -128, 128).astype(np.float32)
    sc = np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] != 0))
    sc = np.clip(sc, -128, 127).astype(np.float32)
    step = d[:, None] * sc
    inv = np.divide(1, step, out=np.zeros_like(step), where=step != 0)
    xb = x.reshape(b, 16, 16)
    q = np.rint(xb * inv[..., None])
    np.clip(q, -32, 31, out=q)
    err = np.square(step[..., None] * q - xb).sum((1, 2))
    return d, sc.astype(np.int8), (q + 32).astype(np.uint8).reshape(b, QK_K), err


def _pack_q6_k(d, sc, q) -> np.ndarray:
    # each 128 weights: 64 bytes of low nibbles (weights 0-63 low, 64-127 high) and 32 bytes of top
    # 2-bit pairs (byte l holds weights l, l+32, l+64, l+96 in bits 0-1, 2-3, 4-5, 6-7)
    b = q.shape[0]
    q = q.reshape(b, 2, 4, 32)
    ql = (q[:, :, :2] & 0xF) | (q[:, :, 2:] & 0xF) << 4
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2)
    return np.concatenate([ql.reshape(b, 128), qh.reshape(b, 64), sc.view(np.uint8), _half_bytes(d)], axis=1)


_ENCODERS = {"Q4_K": _encode_q4_k, "Q5_K": _encode_q5_k, "Q6_K": _encode_q6_k}
