"""Linear layers: dense weights, or quantized weights kept packed for a quantized kernel.

On a CPU with verispec's kernels the fast tier runs `PackedLinear`, the exact tier `DenseLinear`
(dense fp32) or `DecodedLinear` (codes); `QuantLinear` (torch's int4 kernels) serves the rest.
Elsewhere dense weights are held transposed ([in, out]): `x @ W_t` beats `F.linear(x, W)` by up to
2x for the skinny decode shapes (see docs/design.md).

On torch's kernels a quantized matrix runs through `_weight_int4pack_mm` (CUDA) / `_weight_int4pack_mm_for_cpu`,
which compute w = (c - 8) * S + Z per group of 32 with codes c in 0..15. Both of our formats map
onto it without re-quantizing (see `verispec.models.quant`):
- 4 bits, w = scale * q + offset: one plane, c = q, S = scale, Z = offset + 8 * scale;
- 8 bits, w = scale * q: two planes, q = 16 * hi + lo, so w = (16 * scale * hi + 8 * scale) +
  scale * (lo - 8), that is (c = hi + 8, S = 16 * scale, Z = 8 * scale) and (c = lo, S = scale, Z = 0).
Only S and Z are rounded (to the activations' dtype). The kernels read 4 bits per weight and pay
per row of x, so they win for decode-sized batches; past `kernel_max_rows` rows (prefill
chunks) the matrix is dequantized for the step, from verispec's own copy of the codes (torch's
packing is private and differs by CPU capability), and runs as a dense matmul.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from verispec import envs
from verispec.models.cpu_kernels import cpu_kernels_available, packed_variant
from verispec.models.gguf_blocks import PACKED_KINDS, GGUFBlocks, Stacked
from verispec.models.linear_base import LinearBase
from verispec.models.quant import QuantizedWeight

# Measured on a 2-core AVX-512 CPU (576 x 1536, bf16): the int4 kernel costs ~11 us per row of x
# past 4 rows; a dequantize (0.7 ms) plus a bf16 matmul overtakes it at about 128 rows.
KERNEL_MAX_ROWS = 64
_CPU_BLOCK_N = 64  # torch's CPU packing takes N in multiples of 64


class Linear(LinearBase):
    holds_dense = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(bias)
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W_t in one fused op (no bias: o and down projections have none)."""
        return torch.addmm(residual, x, self.weight_t)

    def matrix(self) -> torch.Tensor:  # the [N, K] weights (a view)
        return self.weight_t.t()

    def part(self, start: int, size: int, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the columns of weight_t that rows start..start+size of W are, `values` [size, K] as them)."""
        return self.weight_t[:, start : start + size], values.t()


class Int4Plane(nn.Module):
    """One int4 kernel operand: torch's packed codes and the [K/G, N, 2] scales and zeros, plus
    the codes in verispec's own layout for the dense path.

    torch packs codes in a private layout that changes with the CPU capability it dispatches to
    (AVX-512, AVX2, default), so `packed` is only ever handed to torch's kernel. `nibbles` [N, K/2]
    holds code k of row n in byte k // 2 (the low nibble for even k): `dense()` decodes from it."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        n, k = codes.shape
        self.n, self.k, self.group_size = n, k, group_size
        self.cuda_kernel = device.type == "cuda"
        self.register_buffer("nibbles", pack_nibbles(codes).to(device), persistent=False)
        pad = -n % (8 if self.cuda_kernel else _CPU_BLOCK_N)
        if pad:  # padded rows have zero scale and zero: they compute 0 and are sliced off
            codes = F.pad(codes, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        self.register_buffer("packed", _pack(codes.to(device), self.cuda_kernel), persistent=False)
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda_kernel:
            y = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return y if y.shape[-1] == self.n else y[..., : self.n]

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [N, K] matrix the kernel computes with, (c - 8) * S + Z, in the activations' dtype
        (or `dtype`: in fp32 every value is exact)."""
        sz = self.scales_and_zeros[:, : self.n]  # [K/G, N, 2]
        if dtype is not None:
            sz = sz.to(dtype)
        groups = self.k // self.group_size
        codes = unpack_nibbles(self.nibbles).view(self.n, groups, self.group_size)
        c = codes.to(sz.dtype).sub_(8)
        # One rounding of (c - 8) * S + Z, into a buffer laid out as [N, K].
        return torch.addcmul(sz[..., 1].t()[..., None], c, sz[..., 0].t()[..., None], out=torch.empty_like(c)).view(self.n, self.k)


@functools.cache
def _bf16_matmul_native() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def dense_matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the dense prefill matmul: the activations', except bf16 on a CPU without bf16
    instructions (AVX2), where oneDNN's bf16 GEMM runs about 4x slower than fp32 (576 x 3072 x 630:
    137 ms against 36 ms); the fp32 product is then rounded to bf16 once."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not _bf16_matmul_native():
        return torch.float32
    return x.dtype


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] bytes: code 2j in the low nibble of byte j, 2j + 1 in the high."""
    c = codes.to(torch.uint8)
    return (c[:, ::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: [N, K/2] bytes -> [N, K] uint8 codes."""
    return torch.stack([nibbles & 0x0F, nibbles >> 4], -1).view(nibbles.shape[0], -1)


def _pack(codes: torch.Tensor, cuda_kernel: bool) -> torch.Tensor:
    if not cuda_kernel:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    k = codes.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    pairs = (codes[:, ::2].to(torch.uint8) << 4) | codes[:, 1::2].to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)


class QuantLinear(LinearBase):
    """A quantized matrix on the int4 kernels: one plane for 4 bits, two for 8 bits.

    `dense` is an existing [N, K] copy of the same values (the tied embedding table) used past
    `kernel_max_rows` instead of dequantizing."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device,
                 bias: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                 kernel_max_rows: int = KERNEL_MAX_ROWS):
        super().__init__(None if bias is None else bias.to(device=device, dtype=dtype))
        g = weight.group_size
        if weight.bits == 4:
            specs = [(weight.codes, weight.scale, weight.offset + 8 * weight.scale)]
        else:
            hi = torch.div(weight.codes, 16, rounding_mode="floor").to(torch.int16)
            lo = weight.codes.to(torch.int16) - 16 * hi
            # The coarse plane carries the value (and the +8s that centres the fine plane's codes),
            # the fine plane a zero-mean correction: two large partial sums of opposite sign would
            # lose the result to the bf16 rounding of each kernel's output.
            specs = [(hi + 8, 16 * weight.scale, 8 * weight.scale), (lo, weight.scale, torch.zeros_like(weight.scale))]
        self.planes = nn.ModuleList(Int4Plane(c.to(torch.uint8), s, z, g, dtype, device) for c, s, z in specs)
        self._plane_list = tuple(self.planes)
        self.dense = dense
        self.kernel_max_rows = kernel_max_rows

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        planes = self._plane_list  # a tuple: slicing the ModuleList would build a new module per call
        # A compiled stack only takes kernel-sized batches (models/compile.py) and must not branch.
        if torch.compiler.is_compiling() or x.shape[0] <= self.kernel_max_rows:
            return planes[0](x) if len(planes) == 1 else planes[0](x) + planes[1](x)
        dtype = dense_matmul_dtype(x)
        if self.dense is not None:
            return F.linear(x.to(dtype), self.dense.to(dtype)).to(x.dtype)
        w = planes[0].dense(dtype) if len(planes) == 1 else planes[0].dense(dtype) + planes[1].dense(dtype)
        return F.linear(x.to(dtype), w).to(x.dtype)


class DecodedLinear(LinearBase):
    """A quantized matrix on verispec's CPU kernel (`csrc/quant_linear.cpp`): each weight decoded
    exactly to fp32 (scale * code, plus the offset for 4 bits), fp32 sums, fp32 output, and the
    same arithmetic whatever the number of rows, so there is no dense path past some batch size.
    It runs the 8-bit lm_head in every CPU tier and every matrix of the exact quantized tier
    (`dtype="float32", quantization="gguf"`)."""

    def __init__(self, weight: QuantizedWeight, device: torch.device):
        super().__init__(None)
        self.n = weight.shape[0]
        codes = weight.codes.to(torch.int8 if weight.bits == 8 else torch.uint8)
        per_group = [weight.scale.float()] + ([] if weight.offset is None else [weight.offset.float()])
        # [N/16, K, 16] and [N/16, K/G, 16]: each block of 16 output columns contiguous over K;
        # `_blocked` pads the last block with zero codes, scales and offsets (they compute 0).
        self.register_buffer("codes", _blocked(codes).to(device), persistent=False)
        self.register_buffer("scales", _blocked(per_group[0]).to(device), persistent=False)
        self.register_buffer("offsets", _blocked(per_group[1]).to(device) if len(per_group) > 1 else None,
                             persistent=False)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.offsets is None:
            return torch.ops.verispec_cpu.int8_linear.default(x, self.codes, self.scales, self.n)
        return torch.ops.verispec_cpu.int4_linear.default(x, self.codes, self.scales, self.offsets, self.n)


class DenseLinear(LinearBase):
    """A dense matrix (fp32: the exact tier; bf16 / fp16: a dense half-precision model) on
    verispec's kernel (`csrc/quant_linear.cpp`): fp32 sums in one order whatever the row count, so a
    row's bits never depend on its neighbours (BLAS's do); a half-precision output rounds once."""

    holds_dense = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(None if bias is None else bias.to(weight.dtype))
        self.n, self.k = weight.shape
        self.register_buffer("blocked", _blocked(weight), persistent=False)  # [N/16, K, 16], the weight's dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the bias added in fp32, one rounding; casts no-ops in fp32
        y = torch.ops.verispec_cpu.dense_linear.default(x.float(), self.blocked, self.n)
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.verispec_cpu.dense_linear.default(x.float(), self.blocked, self.n).to(x.dtype)

    def matrix(self) -> torch.Tensor:  # the [N, K] weights (a copy)
        return self.blocked.transpose(1, 2).reshape(-1, self.k)[: self.n]

    def part(self, start: int, size: int, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Linear.part for blocks of 16 rows; None where the rows split a block (rebuild instead)."""
        if start % 16 or (size % 16 and start + size != self.n):
            return None
        # Whole blocks: a strided view, laid out by the commit's copy (no fresh temporaries to fault in).
        view = values.reshape(-1, 16, self.k).transpose(1, 2) if size % 16 == 0 else _blocked(values)
        return self.blocked[start // 16 : -(-(start + size) // 16)], view


def dense_kernel_wanted(dtype: torch.dtype, device: torch.device) -> bool:  # dense on a CPU with the kernels
    return dtype in (torch.float32, torch.bfloat16, torch.float16) and torch.device(device).type == "cpu" \
        and cpu_kernels_available()


def _blocked(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [N/16, C, 16], padding N with zeros to a multiple of 16: one copy (a pad, then a
    transposing copy, wrote a 1B exact-tier model twice: 7.6 s of its load)."""
    n, c = t.shape
    out = torch.empty(-(-n // 16), c, 16, dtype=t.dtype, device=t.device)
    whole = n // 16
    rows = t[: whole * 16].view(whole, 16, c)
    for c0 in range(0, c, 256):  # 256 columns at a time: each block's 16 rows stay in cache (2x faster)
        out[:whole, c0 : c0 + 256].copy_(rows[:, :, c0 : c0 + 256].transpose(1, 2))
    if whole < out.shape[0]:
        out[whole:].copy_(F.pad(t[whole * 16 :], (0, 0, 0, 16 - n % 16)).view(1, 16, c).transpose(1, 2))
    return out


class PackedLinear(LinearBase):
    """A GGUF-format matrix on verispec's packed kernel (`csrc/packed_linear.cpp`): Q4_0, Q4_1,
    Q8_0, Q5_0, Q5_1 (groups of 32, fp16 scales) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks
    of 256, their 6- or 8-bit sub-block scales decoded in the kernel), the file's blocks put into
    the kernel's layout with nothing widened: 4-bit codes two per byte, a fifth or sixth bit in
    planes beside them. Read once per call for all its rows; activations quantized per group of
    32 (int8, with an int8 residual in outlier groups; int16 for 8-bit codes), exact integer dot
    products. The fast tier's kernel for every row on a CPU, decode, verify and prefill chunks of
    any length: a row's result does not depend on the rows beside it nor on the instruction set,
    so the tier is batch-invariant (docs/rl.md). Long calls go in panels of rows whose activations
    stay in L2, which keeps long prefill chunks about as fast as a dense bf16 matmul
    (docs/design.md). `float_output` (the lm_head) returns fp32 logits whatever the activations'
    dtype."""

    def __init__(self, weight: "QuantizedWeight | GGUFBlocks", device: torch.device,
                 bias: torch.Tensor | None = None, float_output: bool = False):
        super().__init__(None if bias is None else bias.to(device))
        self.n = weight.shape[0]
        if isinstance(weight, GGUFBlocks):
            codes, scales, offsets, self.format = weight.packed()
        else:
            self.format = packed_format(weight)
            assert self.format is not None, "make_linear checks packed_format first"
            codes = torch.ops.verispec_cpu.packed_codes(weight.codes, weight.bits)
            scales = _blocked(weight.scale.half())
            offsets = _blocked(weight.offset.half()) if self.format == PACKED_FORMATS["Q4_1"] else None
        self.register_buffer("codes", codes.to(device), persistent=False)
        self.register_buffer("scales", scales.to(device), persistent=False)
        self.register_buffer("offsets", None if offsets is None else offsets.to(device), persistent=False)
        self.float_output = float_output
        self.variant = packed_variant()  # the best this CPU runs, unless a comparison names one

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_output:
            x = x.float()
        return torch.ops.verispec_cpu.packed_linear(x, self.codes, self.scales, self.offsets, self.format, self.n,
                                                    self.variant)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the matrix, each weight its exact value rounded once to `dtype`: a tied
        embedding's lookup, with no dense table beside the packed one."""
        return torch.ops.verispec_cpu.packed_rows(ids, self.codes, self.scales, self.offsets, self.format, self.n, dtype)


class StackedLinear(LinearBase):
    """Matrices of different formats stacked along N (`gguf_blocks.Stacked`), each on its own
    kernel, their outputs side by side: what one matrix would give, row by row."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None = None):
        super().__init__(bias)
        self.parts = nn.ModuleList(parts)
        self._part_list = tuple(parts)  # a tuple: iterating the ModuleList costs more per call

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self._part_list], dim=-1)


# The packed kernel's `format` argument.
PACKED_FORMATS = {kind: i for i, kind in enumerate(PACKED_KINDS)}


def packed_format(weight: QuantizedWeight) -> int | None:
    """The packed kernel's format for `weight`, or None if it has none: groups of 32, and scales
    (and offsets) that fp16 holds exactly, as a GGUF file's do. An offset of exactly -8 x scale
    is Q4_0 (no offsets to read)."""
    if weight.group_size != 32 or weight.shape[1] % 32 or not _fp16_exact(weight.scale):
        return None
    if weight.bits == 8:
        return PACKED_FORMATS["Q8_0"]
    if torch.equal(weight.offset, -8 * weight.scale):
        return PACKED_FORMATS["Q4_0"]
    return PACKED_FORMATS["Q4_1"] if _fp16_exact(weight.offset) else None


def _fp16_exact(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) and bool(torch.equal(t.half().float(), t.float()))


def packed_wanted(weight: "QuantizedWeight | GGUFBlocks", dtype: torch.dtype, device: torch.device) -> bool:
    """The fast tier's CPU matrices (and its 8-bit lm_head) run packed when the kernels are here;
    The environment's packed-kernel switch (verispec/envs.py) puts them back on torch's int4
    kernel (for comparisons)."""
    packable = isinstance(weight, GGUFBlocks) or packed_format(weight) is not None
    return (dtype != torch.float32 and torch.device(device).type == "cpu" and packable
            and envs.packed_kernel_enabled() and cpu_kernels_available())


def make_linear(weight, dtype: torch.dtype, device: torch.device, bias: torch.Tensor | None = None,
                head: bool = False, **quant_options) -> LinearBase:
    """A dense `Linear` for a tensor. For a `QuantizedWeight` on a CPU with verispec's kernels:
    `PackedLinear` in the fast tier, `DecodedLinear` for every matrix of an fp32 model (the exact
    tier on the codes). Elsewhere a `QuantLinear` on torch's int4 kernels where K suits them
    (a multiple of the group size), an exact `DecodedLinear` for an 8-bit lm_head (`head`), else
    the dense values (an fp32 model without the kernels: exact, slower). A GGUF file's blocks
    (`GGUFBlocks`) run packed in the fast tier, and elsewhere as their decoded codes; matrices of
    different formats stacked along N (`Stacked`) run side by side."""
    if isinstance(weight, Stacked):
        parts = [make_linear(p, dtype, device, head=head, **quant_options) for p in weight.parts]
        return StackedLinear(parts, None if bias is None else bias.to(device=device, dtype=dtype))
    if isinstance(weight, GGUFBlocks):
        if packed_wanted(weight, dtype, device):
            return PackedLinear(weight, device, None if bias is None else bias.to(dtype), float_output=head)
        weight = weight.decoded()
    if isinstance(weight, QuantizedWeight):
        if packed_wanted(weight, dtype, device):
            bias = None if bias is None else bias.to(dtype)
            return PackedLinear(weight, device, bias, float_output=head)  # any number of rows: no dense table
        wants_decoded = (head and weight.bits == 8) or dtype == torch.float32
        if wants_decoded and bias is None and decoded_wanted(weight, device):
            return DecodedLinear(weight, device)
        if dtype == torch.float32:  # no kernel for it here: the same values, decoded up front
            weight = weight.dequantize()
    if isinstance(weight, QuantizedWeight):
        if weight.bits in (4, 8) and weight.shape[1] % weight.group_size == 0 and weight.group_size in (32, 64, 128, 256):
            return QuantLinear(weight, dtype, device, bias, **quant_options)
        weight = weight.dequantize()
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if dense_kernel_wanted(dtype, device):
        return DenseLinear(weight.to(device=device, dtype=dtype), bias)
    return Linear(weight.to(device=device, dtype=dtype), bias)


def decoded_wanted(weight: QuantizedWeight, device: torch.device) -> bool:
    return torch.device(device).type == "cpu" and weight.shape[1] % weight.group_size == 0 and cpu_kernels_available()
