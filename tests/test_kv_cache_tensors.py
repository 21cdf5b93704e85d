"""The paged cache's tensors (models/kv_cache_tensors.py): the kernel's transposed key blocks where it runs."""

from __future__ import annotations

import torch

from verispec.models.cpu_kernels import cpu_kernels_available
from verispec.models.kv_cache_tensors import KVCacheTensors, kernel_layout, new_layer_cache


def test_keys_are_transposed_within_a_block_exactly_where_the_kernel_reads_them():
    kernel = cpu_kernels_available()
    cache = new_layer_cache(3, 16, 2, 32, torch.bfloat16, "cpu")
    assert cache.keys_transposed == kernel == kernel_layout(torch.device("cpu"), 16, 32)
    assert cache.k.shape == ((3, 2, 32, 16) if kernel else (3, 16, 2, 32)) and cache.v.shape == (3, 16, 2, 32)
    assert not new_layer_cache(3, 4, 2, 32, torch.bfloat16, "cpu").keys_transposed  # blocks of 4: SDPA's layout
    assert not kernel_layout(torch.device("cuda"), 16, 32)


def test_one_cache_per_layer():
    class Cfg:
        num_layers, num_kv_heads, head_dim = 3, 1, 16

    layers = KVCacheTensors(Cfg, 2, 16, torch.float32, "cpu").layers
    assert len(layers) == 3 and len({id(c.k) for c in layers}) == 3
