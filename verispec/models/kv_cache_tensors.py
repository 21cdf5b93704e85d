"""The paged KV cache's tensors: one `LayerCache` (keys, values) per layer, with the keys of a block
transposed where verispec's CPU attention kernel reads them (models/attention.py attends over them)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from verispec.models.cpu_kernels import cpu_kernels_available


class LayerCache(NamedTuple):
    """One layer's paged cache. v is [blocks, block_size, kv_heads, head_dim]; k is the same, or
    [blocks, kv_heads, head_dim, block_size] when `keys_transposed` (the CPU kernel's layout)."""

    k: torch.Tensor
    v: torch.Tensor
    keys_transposed: bool = False


def kernel_layout(device: torch.device, block_size: int, head_dim: int) -> bool:
    """Whether caches on this device use the CPU attention kernel (and so its key layout)."""
    return device.type == "cpu" and block_size % 16 == 0 and head_dim % 16 == 0 and cpu_kernels_available()


def new_layer_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device) -> LayerCache:
    transposed = kernel_layout(torch.device(device), block_size, head_dim)
    k_shape = (num_blocks, kv_heads, head_dim, block_size) if transposed else (num_blocks, block_size, kv_heads, head_dim)
    v_shape = (num_blocks, block_size, kv_heads, head_dim)
    return LayerCache(_zeros(k_shape, dtype, device), _zeros(v_shape, dtype, device), transposed)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros; on the CPU, pages the kernel hands out zeroed on first touch (calloc of a large size maps
    fresh pages), cache-line aligned. torch.zeros writes every byte: 0.45 s for the default 1 GiB
    cache at start-up, most of which a short run never uses."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    raw = np.zeros(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return torch.from_numpy(raw[start : start + size]).view(dtype).view(shape)


class KVCacheTensors:
    """One `LayerCache` (k, v) per layer: [num_blocks, block_size, kv_heads, head_dim] each, the
    keys transposed within a block where the CPU attention kernel runs."""

    def __init__(self, cfg, num_blocks: int, block_size: int, dtype, device):
        self.layers = [new_layer_cache(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
                       for _ in range(cfg.num_layers)]
