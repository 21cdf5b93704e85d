"""Attention over the paged KV cache for a flat batch of tokens from many requests.

The per-step metadata is built once on the host (`build_attention_metadata`) and reused by every
layer: Python work per layer is the enemy on a CPU, so each layer does one cache write plus one
SDPA call per *group*, never a loop over requests.

On a CPU, verispec's kernel (`csrc/paged_attention.cpp`) writes the step's keys and values and
attends every row straight from the cache blocks, with no gather and no mask; its key cache holds
each block transposed (`LayerCache.keys_transposed`). A row's result depends only on its own query
and keys, never on how the step was cut: a verify row, a decode row and the same position inside
a prefill chunk of any length compute bit for bit alike.

Elsewhere (CUDA, or no C++ compiler) attention runs on SDPA, in groups:
- one "decode" group holds every request with a short query (plain decode or 1 + k verify rows),
  padded to the longest query and the longest context in the group;
- each prefill chunk is its own group, so a 512-token chunk never pads a 1-token decode.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from verispec.device_copy import to_device
from verispec.models.kv_cache_tensors import LayerCache

# Queries at most this long share the padded decode group.
DECODE_GROUP_MAX_QUERY = 16


@dataclass(slots=True)
class SeqSpan:
    """One request's part of the flat batch, as the runner sees it on the host."""

    start: int  # first row in the flat batch
    num_query: int  # new tokens this step
    context_len: int  # tokens in the cache after this step (computed before + new)
    block_table: list[int]  # cache blocks holding positions [0, context_len)


@dataclass(slots=True)
class AttnGroup:
    query_index: torch.Tensor | None  # [G, Q] rows of the flat batch (None: contiguous slice)
    row_start: int  # contiguous case: first row
    num_seqs: int
    max_query: int
    kv_blocks: torch.Tensor | None  # [G * NB] block tables, flat (None: attend to the fresh k/v only)
    # One sequence whose blocks are consecutive, [first, last + 1): the cache is sliced, not gathered.
    kv_run: tuple[int, int] | None
    mask: torch.Tensor | None  # [G, 1, Q, NB*block_size] additive (0 / -inf); None with causal=True
    causal: bool
    out_valid: torch.Tensor | None  # positions in the flattened [G*Q] output that are real rows
    out_rows: torch.Tensor | None  # their rows in the flat batch
    # bf16 decode rows attend in a kv-head-major layout (see _head_major_attention): each request row
    # becomes a head of its own, so a verify row computes exactly as the same row decoded alone.
    head_major: bool = False
    head_major_masks: dict = field(default_factory=dict)  # number of kv heads -> mask
    covers_batch: bool = False  # its real rows are the whole flat batch, in order: no scatter
    # Sliding-window layers: each query row's position [G, Q], the keys' [K]; the group as such a
    # layer sees it, built by the first one and kept by window.
    q_pos: torch.Tensor | None = None
    key_pos: torch.Tensor | None = None
    windowed: dict = field(default_factory=dict)

    def masked(self, window: int, dtype: torch.dtype) -> "AttnGroup":
        """As a layer sliding over `window` keys sees it (a fresh prefill's causal shortcut: a mask)."""
        if not window:
            return self
        grp = self.windowed.get(window)
        if grp is None:
            q_pos, keys = self.q_pos[:, :, None], self.key_pos[None, None, :]
            near = _additive(((keys <= q_pos) & (keys > q_pos - window))[:, None], dtype)  # [G, 1, Q, K]
            mask = near if self.mask is None else self.mask + near
            grp = self.windowed[window] = replace(self, mask=mask, causal=False, head_major_masks={}, windowed={})
        return grp


@dataclass(slots=True)
class KernelSeqs:
    """The step's sequences as the CPU kernel takes them."""

    seqs: torch.Tensor  # [S, 3] int64: first row, query rows, context length
    tables: torch.Tensor  # [S, NB] int64 block tables, padded with block 0 (never read)


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step; the first layer builds the form its cache takes (SDPA groups or the
    kernel's tensors) and the other layers reuse it."""

    slot_mapping: torch.Tensor  # [T] cache slot written by each token of the flat batch
    spans: list[SeqSpan]
    block_size: int
    dtype: torch.dtype
    num_tokens: int
    _groups: list[AttnGroup] | None = None
    _kernel: KernelSeqs | None = None

    @property
    def groups(self) -> list[AttnGroup]:
        """SDPA groups: the padded decode group (if any query is short), then one per prefill chunk."""
        if self._groups is None:
            dev, bs = self.slot_mapping.device, self.block_size
            decode = [s for s in self.spans if s.num_query <= DECODE_GROUP_MAX_QUERY]
            groups = [_padded_group(decode, bs, dev, self.dtype)] if decode else []
            groups += [_prefill_group(s, bs, dev, self.dtype) for s in self.spans if s.num_query > DECODE_GROUP_MAX_QUERY]
            ends = [0] + [s.start + s.num_query for s in self.spans]
            groups[0].covers_batch = len(groups) == 1 and all(s.start == e for s, e in zip(self.spans, ends))
            self._groups = groups
        return self._groups

    @property
    def kernel(self) -> KernelSeqs:
        if self._kernel is None:
            tables, width = _padded_tables(self.spans, self.block_size)  # padding is never read
            dev, n = self.slot_mapping.device, len(self.spans)
            seqs = [x for s in self.spans for x in (s.start, s.num_query, s.context_len)]
            self._kernel = KernelSeqs(seqs=to_device(seqs, dtype=torch.long, device=dev).view(n, 3),
                                      tables=to_device(tables, dtype=torch.long, device=dev).view(n, width))
        return self._kernel


def build_attention_metadata(
    spans: list[SeqSpan], block_size: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> AttentionMetadata:
    slot_mapping: list[int] = []
    for span in spans:
        table = span.block_table
        slot_mapping.extend(
            table[pos // block_size] * block_size + pos % block_size
            for pos in range(span.context_len - span.num_query, span.context_len)
        )
    return AttentionMetadata(
        slot_mapping=to_device(slot_mapping, dtype=torch.long, device=device), spans=spans,
        block_size=block_size, dtype=dtype, num_tokens=len(slot_mapping),
    )


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> additive float mask, once per step (SDPA would convert it in every layer)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _run(blocks: list[int]) -> tuple[int, int] | None:
    """(first, last + 1) when the blocks are consecutive and ascending, else None."""
    first, end = blocks[0], blocks[0] + len(blocks)
    return (first, end) if blocks == list(range(first, end)) else None


def _num_blocks(context_len: int, block_size: int) -> int:
    return -(-context_len // block_size)


def _padded_tables(spans: list[SeqSpan], block_size: int) -> tuple[list[int], int]:
    """The spans' block tables cut to their contexts and padded with block 0 to the widest, flat."""
    counts = [_num_blocks(s.context_len, block_size) for s in spans]
    width = max(counts)
    return [b for s, nb in zip(spans, counts) for b in s.block_table[:nb] + [0] * (width - nb)], width


def _prefill_group(span: SeqSpan, block_size: int, device: torch.device, dtype: torch.dtype) -> AttnGroup:
    fresh = span.context_len == span.num_query  # no earlier chunk: attend to this chunk's k/v
    kv_blocks = mask = kv_run = None
    rows_pos = torch.arange(span.num_query, device=device)[None, :] + span.context_len - span.num_query  # [1, Q]
    key_pos = rows_pos[0]
    if not fresh:
        nb = _num_blocks(span.context_len, block_size)
        kv_blocks = to_device(span.block_table[:nb], dtype=torch.long, device=device)
        kv_run = _run(span.block_table[:nb])
        key_pos = torch.arange(nb * block_size, device=device)
        allowed = (key_pos[None, :] <= rows_pos[0][:, None]) & (key_pos[None, :] < span.context_len)
        mask = _additive(allowed[None, None], dtype)
    return AttnGroup(
        query_index=None, row_start=span.start, num_seqs=1, max_query=span.num_query,
        kv_blocks=kv_blocks, kv_run=kv_run, mask=mask, causal=fresh, out_valid=None, out_rows=None,
        q_pos=rows_pos, key_pos=key_pos,
    )


def _padded_group(spans: list[SeqSpan], block_size: int, device: torch.device, dtype: torch.dtype) -> AttnGroup:
    g = len(spans)
    max_q = max(s.num_query for s in spans)
    tables, max_nb = _padded_tables(spans, block_size)  # padding blocks are masked out
    max_k = max_nb * block_size
    contiguous = max_q == 1 and all(s.start == spans[0].start + i for i, s in enumerate(spans))
    query_index = out_valid = out_rows = None
    if not contiguous:
        q_idx, valid, rows = [], [], []
        for i, s in enumerate(spans):
            q_idx.extend(range(s.start, s.start + s.num_query))
            q_idx.extend([s.start] * (max_q - s.num_query))  # padding repeats a real row
            valid.extend(range(i * max_q, i * max_q + s.num_query))
            rows.extend(range(s.start, s.start + s.num_query))
        query_index = to_device(q_idx, dtype=torch.long, device=device).view(g, max_q)
        out_valid = to_device(valid, dtype=torch.long, device=device)
        out_rows = to_device(rows, dtype=torch.long, device=device)
    kv_blocks = to_device(tables, dtype=torch.long, device=device)
    ctx = to_device([s.context_len for s in spans], device=device)
    nq = to_device([s.num_query for s in spans], device=device)
    q_pos = (ctx - nq)[:, None] + torch.arange(max_q, device=device)[None, :]  # [G, Q]
    keys = torch.arange(max_k, device=device)[None, None, :]
    # Causal within the request and never past its own context; padded query rows see every real
    # key, which keeps them finite (they are dropped afterwards).
    mask = (keys <= q_pos[:, :, None]) & (keys < ctx[:, None, None])  # [G, Q, K]
    head_major = dtype != torch.float32
    return AttnGroup(
        query_index=query_index, row_start=spans[0].start, num_seqs=g, max_query=max_q,
        kv_blocks=kv_blocks, kv_run=_run(tables) if g == 1 else None, mask=_additive(mask[:, None], dtype),
        causal=False, out_valid=out_valid, out_rows=out_rows,
        head_major=head_major, q_pos=q_pos, key_pos=keys[0, 0],
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """Writes this step's k/v into the cache, then attends; returns [T, H, D]. window: a sliding
    layer's (0: none); softcap: scores -> cap * tanh(scores / cap) (0: none)."""
    if cache.keys_transposed:
        return _kernel_attention(q, k, v, cache, meta, scale, window, softcap)
    k_cache, v_cache = cache.k, cache.v
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    gqa = num_heads != kv_heads
    groups = [g.masked(window, q.dtype) for g in meta.groups]
    if len(groups) == 1 and groups[0].causal:  # one fresh prefill: no gathers at all
        out = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True, scale,
                    softcap, gqa)
        return out[0].transpose(0, 1)
    if len(groups) == 1 and groups[0].covers_batch:  # every row in one group: no scatter
        return _group_attention(q, k, v, k_cache, v_cache, groups[0], scale, softcap)
    out = torch.empty_like(q)
    for grp in groups:
        og = _group_attention(q, k, v, k_cache, v_cache, grp, scale, softcap)
        if grp.out_rows is None:
            out[grp.row_start : grp.row_start + og.shape[0]] = og
        else:
            out[grp.out_rows] = og
    return out


def _sdpa(q, k, v, mask, causal: bool, scale: float, softcap: float, gqa: bool) -> torch.Tensor:
    """SDPA over [B, H, Q, D]; with a soft-cap, the same in plain ops (SDPA has no soft-cap), the
    softmax in fp32 as the reference implementation does."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    if causal:  # the last query row sees every key
        n, m = scores.shape[-2:]
        mask = _additive(torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n), scores.dtype)
    if mask is not None:
        scores = scores + mask
    return scores.float().softmax(-1).to(q.dtype) @ v


def _kernel_attention(q, k, v, cache: LayerCache, meta: AttentionMetadata, scale, window, softcap) -> torch.Tensor:
    """The CPU kernel writes every row's k/v into the cache, then attends every row."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    seqs = meta.kernel
    torch.ops.verispec_cpu.paged_attention.default(q, k, v, cache.k, cache.v, meta.slot_mapping, seqs.seqs, seqs.tables,
                                                scale, window, softcap, out)
    return out


def _group_attention(q, k, v, k_cache, v_cache, grp: AttnGroup, scale: float, softcap: float) -> torch.Tensor:
    """One group's attention: its real rows' outputs, [rows, H, D] in flat-batch order."""
    g, nq = grp.num_seqs, grp.max_query
    num_heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    if grp.query_index is None:
        qg = q[grp.row_start : grp.row_start + g * nq].view(g, nq, num_heads, head_dim)
    else:
        qg = q[grp.query_index]  # [G, Q, H, D]
    if grp.kv_blocks is None:
        rows = slice(grp.row_start, grp.row_start + nq)
        kg, vg = k[rows][None], v[rows][None]
    elif grp.kv_run is not None:
        kg = k_cache[grp.kv_run[0] : grp.kv_run[1]].view(1, -1, kv_heads, head_dim)
        vg = v_cache[grp.kv_run[0] : grp.kv_run[1]].view(1, -1, kv_heads, head_dim)
    else:  # [G*NB, bs, KV, D] -> [G, NB*bs, KV, D]
        kg = k_cache.index_select(0, grp.kv_blocks).view(g, -1, kv_heads, head_dim)
        vg = v_cache.index_select(0, grp.kv_blocks).view(g, -1, kv_heads, head_dim)
    if grp.head_major:
        og = _head_major_attention(qg, kg, vg, grp, scale, softcap)
    else:
        og = _sdpa(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), grp.mask, grp.causal, scale, softcap,
                   num_heads != kv_heads).transpose(1, 2)  # [G, Q, H, D]
    og = og.reshape(g * nq, num_heads, head_dim)
    return og if grp.out_valid is None else og[grp.out_valid]


def _head_major_attention(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, grp: AttnGroup,
                          scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Decode attention for bf16 models: [G, Q, H, D] queries as [G, KV * Q, H/KV, D], one head
    per (kv head, request row) holding that kv head's H/KV query heads as its rows, with the
    row's causal mask. In bf16, SDPA rounds a head's result the same whatever the number of heads
    (800 of 800 random cases) but not whatever its number of rows, which here is always H/KV: a
    verify row computes exactly as a plain decode row. It is also 5x faster than one row per head
    (16 sequences x 160 keys: 0.22 ms against 1.2 ms). Returns [G, Q, H, D]."""
    g, nq, num_heads, head_dim = qg.shape
    kv_heads = kg.shape[2]
    per_kv = num_heads // kv_heads
    folded = qg.view(g, nq, kv_heads, per_kv, head_dim).transpose(1, 2).reshape(g, kv_heads * nq, per_kv, head_dim)
    mask = grp.head_major_masks.get(kv_heads)
    if mask is None:  # built by the first layer, reused by the others
        keys = grp.mask.shape[-1]
        mask = grp.mask.view(g, 1, nq, 1, keys).expand(g, kv_heads, nq, 1, keys)
        grp.head_major_masks[kv_heads] = mask = mask.reshape(g, kv_heads * nq, 1, keys)
    out = _sdpa(folded, kg.transpose(1, 2), vg.transpose(1, 2), mask, False, scale, softcap, nq > 1)
    return out.view(g, kv_heads, nq, per_kv, head_dim).transpose(1, 2).reshape(g, nq, num_heads, head_dim)


class _Context(threading.local):
    """The running forward's metadata and caches, and its layer: a compiled graph sees attention as
    one opaque op on tensors, and one graph serves many layers. Per thread: the compiled step's
    graphs are checked in another thread while the engine steps."""

    current: tuple[AttentionMetadata, list] | None = None
    layer: int = 0


_context = _Context()


@contextmanager
def attention_context(meta: AttentionMetadata, kv_caches: list):
    outer, _context.current = _context.current, (meta, kv_caches)
    try:
        yield
    finally:
        _context.current = outer


def enter_layer(index: int) -> None:
    """The layer the next attention call serves; each call moves on to the next layer."""
    _context.layer = index


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
              softcap: float = 0.0) -> torch.Tensor:
    """Paged attention for the current layer of the running forward; opaque to torch.compile."""
    if torch.compiler.is_compiling():
        return torch.ops.verispec.attention(q, k, v, scale, window, softcap)
    return _attention_op(q, k, v, scale, window, softcap)


# The cache write is invisible to the compiler on purpose: the op's output is always used, so it
# is never reordered or dropped, and the caches need not become graph inputs. A plain library
# definition has half the dispatch overhead of `torch.library.custom_op`.
_lib = torch.library.Library("verispec", "DEF")
_lib.define("attention(Tensor q, Tensor k, Tensor v, float scale, int window, float softcap) -> Tensor")


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                  softcap: float) -> torch.Tensor:
    meta, caches = _context.current
    layer, _context.layer = _context.layer, _context.layer + 1
    return paged_attention(q, k, v, caches[layer], meta, scale, window, softcap).contiguous()


def _attention_shape(q, k, v, scale: float, window: int, softcap: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


_lib.impl("attention", _attention_op, "CompositeExplicitAutograd")
_lib.impl("attention", _attention_shape, "Meta")
