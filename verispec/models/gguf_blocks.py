"""A GGUF file's quantized matrix as the file stores it: each row's blocks, byte for byte.

The loader hands a `GGUFBlocks` over for every matrix of a type the packed kernel keeps (Q4_0,
Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K). It holds no copy of the bytes: `raw()` reads them
from the file when a layer is built (or re-built by a weight update), so a loaded model holds
the packed layout alone, about the file's size, and no page of the file stays mapped.

- The fast tier packs the rows straight from the bytes (`packed()`: the C++ op `gguf_pack`).
- The exact tier and torch's kernels take `decoded()`: the codes and per-group scales as a
  `QuantizedWeight`, decoded without rounding, so `decoded().dequantize()` is bit for bit what
  gguf's own `dequantize` computes (Q6_K's groups are its sub-blocks of 16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.models.packed_cache import packed_or_made
from verispec.models.quant import TORCH_QUANTIZER, QuantizedWeight, quantize_gguf
from verispec.models.quant import concat_rows as quant_concat_rows
from verispec.models.quant import requantize as quant_requantize

# The packed kernel's formats, in the order of its `format` argument (packed_layout.h).
PACKED_KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# ggml's (inputs, bytes) per block.
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    kind: str  # one of PACKED_KINDS
    shape: tuple[int, int]  # [N, K]
    read: Callable[[], torch.Tensor]  # the rows' bytes, uint8 [N, K / inputs * bytes], freshly made

    @classmethod
    def from_file(cls, path: str | Path, offset: int, kind: str, shape: tuple[int, int]) -> "GGUFBlocks":
        n, k = shape
        count = n * row_bytes(kind, k)

        def read() -> torch.Tensor:
            data = np.fromfile(path, dtype=np.uint8, count=count, offset=offset)
            if data.size != count:
                raise ValueError(f"{path}: the file ends inside a {kind} tensor; is it truncated?")
            return torch.from_numpy(data).view(n, -1)

        return cls(kind, (n, k), read)

    @classmethod
    def of(cls, raw: torch.Tensor | np.ndarray, kind: str, shape: tuple[int, int]) -> "GGUFBlocks":
        """Blocks held in memory (re-quantized values of a weight update, tests)."""
        rows = torch.as_tensor(np.ascontiguousarray(raw)).view(shape[0], row_bytes(kind, shape[1]))
        return cls(kind, tuple(shape), rows.clone)

    def raw(self) -> torch.Tensor:
        return self.read()

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "GGUFBlocks":
        """The rows selected or permuted by `fn` (applied to the bytes when they are read)."""
        read = self.read
        n = fn(torch.arange(self.shape[0])).shape[0]
        return GGUFBlocks(self.kind, (n, self.shape[1]), lambda: fn(read()).contiguous())

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 [N, K] matrix, as gguf's `dequantize` computes it."""
        return self.decoded().dequantize()

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(codes, scales, offsets, format) for the packed kernel (models/linear.py: PackedLinear)."""
        fmt = PACKED_KINDS.index(self.kind)
        made = packed_or_made(self.kind, self.shape,
                              lambda: torch.ops.verispec_cpu.gguf_pack(self.raw(), fmt, self.shape[1]))
        return (*made, fmt)

    def decoded(self) -> QuantizedWeight:
        n, k = self.shape
        inputs, size = BLOCKS[self.kind]
        blocks = self.raw().numpy().reshape(-1, size)
        codes, scale, offset, group = _DECODERS[self.kind](blocks)
        bits = {"Q8_0": 8, "Q6_K": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}.get(self.kind, 4)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).view(n, -1)  # noqa: E731
        return QuantizedWeight(bits, t(codes), t(scale), None if offset is None else t(offset), group, self.kind)


def row_bytes(kind: str, k: int) -> int:
    inputs, size = BLOCKS[kind]
    if k % inputs:
        raise ValueError(f"a {kind} row of {k} inputs does not split into blocks of {inputs}")
    return k // inputs * size


# ------------------------------------------------------------------------------- decoding
# Each decoder takes [blocks, bytes] and returns (codes, scale, offset, group size): codes per
# input, scale and offset per group, as exact fp32 products of the file's fp16 and small ints.
def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-input nibble layout: byte j holds input j (low) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _legacy(head: int, offsets: bool, fifth: bool, signed: bool = False):
    def decode(blocks: np.ndarray):
        d = _f16(blocks, 0)
        m = _f16(blocks, 2) if offsets else None
        if signed:  # Q8_0
            return blocks[:, head:].view(np.int8), d, None, 32
        qs = blocks[:, head + (4 if fifth else 0):]
        codes = _nibbles(qs)
        if fifth:
            high = blocks[:, head : head + 4].copy().view(np.uint32)  # [blocks, 1]
            codes = codes | (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        centre = 16.0 if fifth else 8.0
        return codes, d, (m if offsets else -centre * d), 32
    return decode


def _scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's eight 6-bit scales and mins from their 12 packed bytes, [blocks, 8] each."""
    lo_sc, lo_mn, rest = s[:, 0:4] & 63, s[:, 4:8] & 63, s[:, 8:12]
    hi_sc = (rest & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_mn = (rest >> 4) | ((s[:, 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], 1), np.concatenate([lo_mn, hi_mn], 1)


def _kquant(fifth: bool):
    def decode(blocks: np.ndarray):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _scale_min(blocks[:, 4:16])
        qs = blocks[:, 48:176] if fifth else blocks[:, 16:144]
        pairs = qs.reshape(-1, 4, 32)  # sub-blocks 2i (low nibbles) and 2i + 1 (high) share 32 bytes
        codes = np.stack([pairs & 0x0F, pairs >> 4], axis=2).reshape(-1, 8, 32)
        if fifth:  # bit j of byte l: sub-block j's input l
            qh = blocks[:, 16:48]
            codes = codes | ((((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4))
        return codes.reshape(-1, 256), d * sc, -(dmin * mn), 32
    return decode


def _q6_k(blocks: np.ndarray):
    ql, qh = blocks[:, 0:128].reshape(-1, 2, 2, 32), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    # Per half of 128: ql's two 32-byte rows give inputs 0..31 / 32..63 (low nibbles) and 64..95 /
    # 96..127 (high); qh's byte l gives the top two bits of inputs l, l + 32, l + 64, l + 96.
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [blocks, 2, 4, 32]
    top = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    codes = ((low | (top << 4)).astype(np.int16) - 32).astype(np.int8).reshape(-1, 256)
    return codes, d * sc, None, 16


# IQ4_NL / IQ4_XS: a nibble indexes a table of int8 values, so each weight is an 8-bit code times
# its group's scale (d, or d (ls - 32) per 32 for IQ4_XS), exactly (at most 24 significant bits).
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(blocks: np.ndarray):
    return _IQ4_VALUES[_nibbles(blocks[:, 2:])], _f16(blocks, 0), None, 32


def _iq4_xs(blocks: np.ndarray):
    d = _f16(blocks, 0)
    high = blocks[:, 2:4].copy().view(np.uint16)  # [blocks, 1]: two bits per group
    low = np.concatenate([blocks[:, 4:8, None] & 0x0F, blocks[:, 4:8, None] >> 4], axis=2).reshape(-1, 8)
    ls = low | (((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8) << 4)
    codes = _IQ4_VALUES[_nibbles(blocks[:, 8:].reshape(-1, 16))].reshape(-1, 256)
    return codes, d * (ls.astype(np.float32) - 32), None, 32


# (inputs, bytes, decoder) per block of the types `widened` takes.
_WIDENED = {"IQ4_NL": (32, 18, _iq4_nl), "IQ4_XS": (256, 136, _iq4_xs)}


def widened(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantizedWeight | None:
    """A matrix of a 4-bit type the packed kernel does not take (IQ4_NL, IQ4_XS) as the file's exact
    values in 8-bit codes (twice its bytes; Q8_0's layout where the scales fit fp16); None for
    another type, or a row that is not whole blocks."""
    if kind not in _WIDENED or shape[1] % _WIDENED[kind][0]:
        return None
    _, size, decode = _WIDENED[kind]
    codes, scale, _, group = decode(np.asarray(raw, dtype=np.uint8).reshape(-1, size))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(shape[0], -1)  # noqa: E731
    return QuantizedWeight(8, t(codes), t(scale), None, group, source=kind, exact_source=True)


_DECODERS = {
    "Q4_0": _legacy(2, offsets=False, fifth=False), "Q4_1": _legacy(4, offsets=True, fifth=False),
    "Q8_0": _legacy(2, offsets=False, fifth=False, signed=True),
    "Q5_0": _legacy(2, offsets=False, fifth=True), "Q5_1": _legacy(4, offsets=True, fifth=True),
    "Q4_K": _kquant(fifth=False), "Q5_K": _kquant(fifth=True), "Q6_K": _q6_k,
}


# ------------------------------------------------------------------------ stacking, updates
@dataclass(frozen=True, slots=True)
class Stacked:
    """Matrices of different formats stacked along N, kept apart (llama.cpp's Q4_K_M writes
    attn_v in Q6_K beside Q4_K q and k): each part runs on its own kernel (linear.StackedLinear)."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])


def concat_rows(parts: list):
    """q|k|v or gate|up: one matrix where the parts share a format (quant.concat_rows for dense
    tensors and round-to-nearest codes), else the parts side by side (`Stacked`)."""
    if not any(isinstance(p, GGUFBlocks) for p in parts):
        return quant_concat_rows(parts)
    first = parts[0]
    if all(isinstance(p, GGUFBlocks) and p.kind == first.kind for p in parts):
        reads = [p.read for p in parts]
        n = sum(p.shape[0] for p in parts)
        return GGUFBlocks(first.kind, (n, first.shape[1]), lambda: torch.cat([r() for r in reads]))
    return Stacked(tuple(parts))


def columns(w: GGUFBlocks, lo: int, hi: int) -> "GGUFBlocks | QuantizedWeight | torch.Tensor":
    """Input columns lo..hi (a row-parallel shard): whole blocks stay blocks; a cut inside a block
    takes the decoded codes, one inside a group the exact dense values."""
    inputs, size = BLOCKS[w.kind]
    if lo % inputs or hi % inputs:
        q = w.decoded()
        g = q.group_size
        if lo % g or hi % g:  # a cut inside a group: its exact values, dense
            return q.dequantize()[:, lo:hi]
        return QuantizedWeight(q.bits, q.codes[:, lo:hi].contiguous(), q.scale[:, lo // g : hi // g].contiguous(),
                               None if q.offset is None else q.offset[:, lo // g : hi // g].contiguous(), g, q.kind)
    read, a, b = w.read, lo // inputs * size, hi // inputs * size
    return GGUFBlocks(w.kind, (w.shape[0], hi - lo), lambda: read()[:, a:b].contiguous())


def quantize_blocks(values: torch.Tensor, kind: str) -> GGUFBlocks:
    """Dense [N, K] values as `kind` blocks: gguf's quantizer (llama.cpp's reference rounding) for
    the legacy types, verispec's own (models/kquants.py) for the K-quants."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from verispec.models.kquants import quantize_k

    x = values.detach().float().cpu().numpy()
    raw = quantize_k(x, kind) if kind.endswith("_K") else quantize(x, GGMLQuantizationType[kind])
    return GGUFBlocks.of(raw, kind, tuple(values.shape))


def requantize(values: torch.Tensor, like: "GGUFBlocks | QuantizedWeight") -> "GGUFBlocks | QuantizedWeight":
    """New dense [N, K] values quantized the way `like` was loaded (a weight update): Q4_0 / Q4_1 /
    Q8_0 with verispec's torch quantizer (bit for bit gguf's, in torch's threads), the other GGUF
    types as blocks, an HF checkpoint's int4 / int8 round-to-nearest."""
    if isinstance(like, GGUFBlocks):
        return quantize_gguf(values, like.kind) if like.kind in TORCH_QUANTIZER else quantize_blocks(values, like.kind)
    return quant_requantize(values, like)


def is_quantized(w) -> bool:
    return isinstance(w, (QuantizedWeight, GGUFBlocks, Stacked))


def dequantize(w) -> torch.Tensor:
    """The exact fp32 matrix of any weight form (a dense tensor as fp32)."""
    if isinstance(w, Stacked):
        return torch.cat([dequantize(p) for p in w.parts])
    return w.dequantize() if is_quantized(w) else w.float()
