"""Paged KV cache: the block pool, per-request block tables, and the cache tensors themselves.

The pool only does accounting (host ints); the tensors live in `KVCacheTensors`. A request's
block table covers positions [0, len(table) * block_size). Rolling back rejected draft tokens is
`truncate`, which returns the blocks past the kept length to the pool. The pool also holds the
prefix cache's block map (hash -> block); what a hash covers is core/prefix_cache.py's business.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Callable

from verispec.models.config import ModelConfig

if TYPE_CHECKING:  # the server's frontend imports this module (prefix hashes) and never torch
    import torch


# Without an explicit pool size the KV cache takes at most this much memory.
DEFAULT_KV_CACHE_BYTES = 1 << 30


def num_kv_blocks(config, model_cfg: ModelConfig, num_kv_heads: int | None = None) -> int:
    """The pool's blocks (`config` an EngineConfig): num_kv_blocks, else what kv_cache_bytes holds,
    else every sequence's full length up to DEFAULT_KV_CACHE_BYTES. `num_kv_heads`: a tensor-
    parallel rank's share of each block."""
    per_block = bytes_per_block(model_cfg, config.block_size, config.dtype, num_kv_heads)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_bytes is not None:
        n = config.kv_cache_bytes // per_block
        if n < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no block ({per_block} bytes each)")
        return n
    want = config.max_num_seqs * -(-config.max_model_len // config.block_size)
    return max(1, min(want, DEFAULT_KV_CACHE_BYTES // per_block))


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """A full block's name: its parent's hash chained with its token ids (SHA-256). The prefix
    cache finds blocks by it; the server's frontend routes a prompt to the replica holding it."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """A block's bytes across layers, k and v; num_kv_heads: a tensor-parallel rank's share."""
    elem = dtype.itemsize
    heads = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * elem


class BlockPool:
    """Blocks are reference-counted: a block of a cached prefix can sit in several tables. A free
    block is either plain (`_free`) or still holds a cached prefix (`_evictable`, least recently
    used first); allocation takes plain blocks first and evicts a cached one only when none is left."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # full-block hash -> the block holding its KV
        self.tables: dict[str, list[int]] = {}
        self.on_evict: Callable[[bytes], None] | None = None  # told when a hash leaves the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grows the table to cover num_tokens positions; all or nothing."""
        table = self.tables.setdefault(request_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra <= 0:
            return True
        if extra > self.num_free_blocks:
            if not table:
                del self.tables[request_id]
            return False
        table.extend(self._take() for _ in range(extra))
        return True

    def share(self, request_id: str, blocks: list[int]) -> None:
        """Starts an empty table with cached blocks (a prefix hit); each gains a reference."""
        if self.tables.get(request_id):
            raise RuntimeError(f"{request_id} already holds blocks")
        for b in blocks:
            if self.ref_count[b] == 0:
                del self._evictable[b]
            self.ref_count[b] += 1
        self.tables[request_id] = list(blocks)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keeps the blocks covering the first num_tokens positions, frees the rest."""
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            # Front of the queue: the request's next block is the one it just gave back, so a
            # table stays one run of consecutive blocks, which attention reads without a gather.
            self._release(table.pop(), front=True)

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        # The tail first: the least likely part of a prefix to be asked for again is evicted first.
        for b in reversed(table or ()):
            self._release(b)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of a chain of block hashes."""
        blocks = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def register(self, request_id: str, first: int, hashes: list[bytes]) -> None:
        """Marks table blocks first.. as holding the full blocks `hashes`. A hash cached already
        (the same prefix computed twice at once) keeps its block; the duplicate stays private."""
        table = self.tables.get(request_id, [])
        for b, h in zip(table[first:], hashes):
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b

    def reset_cache(self) -> None:
        """Forgets every cached prefix; blocks in use stay with their requests."""
        for b in list(self._evictable):
            self._free.append(b)
        self._evictable.clear()
        for h in list(self.cached):
            self._uncache(self.cached[h])

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            self._uncache(b)
        self.ref_count[b] = 1
        return b

    def _release(self, b: int, front: bool = False) -> None:
        self.ref_count[b] -= 1
        if self.ref_count[b] > 0:
            return
        if self.block_hash[b] is not None:
            self._evictable[b] = None  # most recently used: evicted last
        elif front:
            self._free.appendleft(b)
        else:
            self._free.append(b)

    def _uncache(self, b: int) -> None:
        h = self.block_hash[b]
        self.block_hash[b] = None
        del self.cached[h]
        if self.on_evict is not None:
            self.on_evict(h)
