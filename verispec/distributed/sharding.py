"""Which part of a checkpoint each tensor-parallel rank holds.

Megatron's split, as vLLM does it:
- column-parallel (output rows split): q/k/v by heads, gate/up by intermediate columns, and
  their biases with them;
- row-parallel (input columns split): o and down; each rank's partial product is all-reduced;
- vocabulary-parallel: the embedding table and lm_head by vocabulary rows.
Heads go in whole KV groups: a rank holds some KV heads and every query head that reads them.
Shards may be uneven (SmolLM2's 3 KV heads over 2 ranks: 2 and 1), so a model never has to be
divisible by the rank count; with fewer KV heads than ranks, each KV head is replicated on
size / num_kv_heads ranks and its query heads are split among them.
Norms and rope are small and replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from verispec.distributed.comm import TPGroup
from verispec.models.config import ModelConfig
from verispec.models.gguf_blocks import GGUFBlocks, columns
from verispec.models.quant import QuantizedWeight

# Row-parallel matrices split their input dimension at multiples of this (GGUF's group size),
# so a quantized shard keeps whole groups.
_ALIGN = 32


@dataclass(slots=True, frozen=True)
class Shard:
    """Rank `rank` of `size`: its heads, intermediate columns and vocabulary rows, [lo, hi)."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]


def _split(n: int, size: int, rank: int, align: int = 1) -> tuple[int, int]:
    """Near-equal contiguous parts of range(n), cut at multiples of align where n allows it."""
    unit = align if n % align == 0 and n // align >= size else 1
    units = n // unit
    return (-(-rank * units // size) * unit, -(-(rank + 1) * units // size) * unit)


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query heads, KV heads) held by `rank`."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = _split(num_kv_heads, size, rank)
        return (kv[0] * group, kv[1] * group), kv
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {num_kv_heads} KV heads "
                         "or be a multiple of them")
    per_kv = size // num_kv_heads  # ranks sharing (replicating) one KV head
    if group < per_kv:
        raise ValueError(f"tensor_parallel_size={size} leaves some rank without a query head "
                         f"({num_heads} heads, {num_kv_heads} KV heads)")
    kv = rank // per_kv
    q = _split(group, per_kv, rank % per_kv)
    return (kv * group + q[0], kv * group + q[1]), (kv, kv + 1)


def make_shard(cfg: ModelConfig, size: int, rank: int) -> Shard:
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
    q, kv = head_split(cfg.num_heads, cfg.num_kv_heads, size, rank)
    return Shard(rank, size, q, kv, _split(cfg.intermediate_size, size, rank, _ALIGN),
                 _split(cfg.vocab_size, size, rank))


def max_kv_heads_per_rank(cfg: ModelConfig, size: int) -> int:
    """The most KV heads any rank holds: what sizes each rank's share of the KV pool."""
    shards = [make_shard(cfg, size, r) for r in range(size)]
    return max(s.kv_heads[1] - s.kv_heads[0] for s in shards)


@dataclass(slots=True)
class ShardContext:
    """What a sharded `LlamaModel` needs at run time: its group and which part it holds."""

    group: "TPGroup"
    shard: Shard
    vocab_widths: list[int]  # every rank's vocabulary rows, in rank order

    @classmethod
    def create(cls, group: "TPGroup", cfg: ModelConfig) -> "ShardContext":
        shards = [make_shard(cfg, group.size, r) for r in range(group.size)]
        return cls(group, shards[group.rank], [s.vocab[1] - s.vocab[0] for s in shards])


def _rows(w, lo: int, hi: int):
    if isinstance(w, (QuantizedWeight, GGUFBlocks)):
        return w.map_rows(lambda t: t[lo:hi])
    return w[lo:hi]


def _cols(w, lo: int, hi: int):
    if isinstance(w, GGUFBlocks):
        return columns(w, lo, hi)
    if isinstance(w, QuantizedWeight):
        g = w.group_size
        if lo % g or hi % g:  # a shard cut inside a group: its exact values, dense
            return w.dequantize()[:, lo:hi]
        return replace(w, codes=w.codes[:, lo:hi], scale=w.scale[:, lo // g : hi // g],
                       offset=None if w.offset is None else w.offset[:, lo // g : hi // g])
    return w[:, lo:hi]


def shard_checkpoint(cfg: ModelConfig, weights: dict, shard: Shard) -> tuple[ModelConfig, dict]:
    """This rank's config (its head and column counts) and tensors, from the whole checkpoint.

    Shards are copies, so the whole checkpoint can be freed once every rank has its part."""
    d = cfg.head_dim
    (q0, q1), (k0, k1), (i0, i1), (v0, v1) = shard.q_heads, shard.kv_heads, shard.inter, shard.vocab
    column = {"q": (q0 * d, q1 * d), "k": (k0 * d, k1 * d), "v": (k0 * d, k1 * d), "gate": (i0, i1), "up": (i0, i1)}
    column |= {f"{name}_bias": span for name, span in list(column.items()) if name in ("q", "k", "v")}
    row = {"o": (q0 * d, q1 * d), "down": (i0, i1)}
    out = {}
    for name, w in weights.items():
        leaf = name.rsplit(".", 1)[-1]
        if name in ("embed", "lm_head"):
            w = _rows(w, v0, v1)
        elif name.startswith("layers.") and leaf in column:
            w = _rows(w, *column[leaf])
        elif name.startswith("layers.") and leaf in row:
            w = _cols(w, *row[leaf])
        out[name] = _copy(w)
    local = replace(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0, vocab_size=v1 - v0)
    return local, out


def _copy(w):
    if isinstance(w, GGUFBlocks):  # read from the file when its layer is built: nothing to copy
        return w
    if isinstance(w, QuantizedWeight):
        return w.map_rows(torch.clone)
    return w.clone()
