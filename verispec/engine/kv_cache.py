"""Paged KV cache: the block pool, per-request block tables, and the cache tensors themselves.

The pool only does accounting (host ints); the tensors live in `KVCacheTensors`. A request's
block table covers positions [0, len(table) * block_size). Rolling back rejected draft tokens is
`truncate`, which returns the blocks past the kept length to the pool.
"""

from __future__ import annotations

from collections import deque

import torch

from verispec.models.attention import new_layer_cache
from verispec.models.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

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
        if extra > len(self._free):
            if not table:
                del self.tables[request_id]
            return False
        table.extend(self._free.popleft() for _ in range(extra))
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keeps the blocks covering the first num_tokens positions, frees the rest."""
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            # Front of the queue: the request's next block is the one it just gave back, so a
            # table stays one run of consecutive blocks, which attention reads without a gather.
            self._free.appendleft(table.pop())

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table:
            # Most recently used blocks go to the back so they are reused last.
            self._free.extend(reversed(table))

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])


class KVCacheTensors:
    """One `LayerCache` (k, v) per layer: [num_blocks, block_size, kv_heads, head_dim] each, the
    keys transposed within a block where the CPU attention kernel runs."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype, device, num_layers=None):
        n = cfg.num_layers if num_layers is None else num_layers
        self.layers = [
            new_layer_cache(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device) for _ in range(n)
        ]
