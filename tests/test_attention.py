"""Paged attention's SDPA path and its metadata (verispec/models/attention.py), against causal attention
computed per request in float64 from the same keys and values: the cache slots each token writes,
the decode / prefill grouping, and outputs for decode, verify and chunked-prefill rows mixed in one
step, with scattered and consecutive block tables. The CPU kernel's path is test_cpu_kernels.py's."""

from __future__ import annotations

import pytest
import torch

from verispec.models import cpu_kernels
from verispec.models.attention import DECODE_GROUP_MAX_QUERY, SeqSpan, build_attention_metadata, paged_attention
from verispec.models.kv_cache_tensors import KVCacheTensors, kernel_layout, new_layer_cache

BLOCK = 4  # not a multiple of 16: the cache takes the SDPA layout, whatever this CPU has
BLOCK_KERNEL = 16
CPU = torch.device("cpu")


def reference(q, k_all, v_all, spans):
    """Per span: its queries against its first context_len keys (k_all/v_all: [S, ctx, KV, D]), causal."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, k, v in zip(spans, k_all, v_all):
        per_kv = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(per_kv, 1), v.double().repeat_interleave(per_kv, 1)
        qs = q[s.start: s.start + s.num_query].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * q.shape[-1] ** -0.5
        pos = torch.arange(s.num_query)[:, None] + s.context_len - s.num_query
        scores = scores.masked_fill(torch.arange(s.context_len)[None] > pos, float("-inf"))
        out[s.start: s.start + s.num_query] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def run_step(shapes, tables, kv_heads=2, heads=4, head_dim=8, seed=0):
    """One step over spans of (query rows, context length); history already in the cache."""
    g = torch.Generator().manual_seed(seed)
    cache = new_layer_cache(32, BLOCK, kv_heads, head_dim, torch.float32, CPU)
    assert not cache.keys_transposed
    spans, start, ks, vs, step_k, step_v = [], 0, [], [], [], []
    for (nq, ctx), table in zip(shapes, tables):
        k = torch.randn(ctx, kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, kv_heads, head_dim, generator=g)
        for pos in range(ctx - nq):  # the history, written by earlier steps
            cache.k[table[pos // BLOCK], pos % BLOCK] = k[pos]
            cache.v[table[pos // BLOCK], pos % BLOCK] = v[pos]
        spans.append(SeqSpan(start, nq, ctx, table))
        ks.append(k), vs.append(v), step_k.append(k[ctx - nq:]), step_v.append(v[ctx - nq:])
        start += nq
    q = torch.randn(start, heads, head_dim, generator=g)
    meta = build_attention_metadata(spans, BLOCK, CPU)
    out = paged_attention(q, torch.cat(step_k), torch.cat(step_v), cache, meta, head_dim ** -0.5)
    return out, reference(q, ks, vs, spans), meta, cache


def test_each_token_writes_the_slot_of_its_position():
    spans = [SeqSpan(0, 2, 6, [7, 3]), SeqSpan(2, 1, 1, [5])]
    meta = build_attention_metadata(spans, BLOCK, CPU)
    # Positions 4 and 5 of the first request live in block 3; position 0 of the second in block 5.
    assert meta.slot_mapping.tolist() == [3 * BLOCK + 0, 3 * BLOCK + 1, 5 * BLOCK]
    assert meta.num_tokens == 3


def test_short_queries_share_one_group_and_each_long_chunk_has_its_own():
    n = DECODE_GROUP_MAX_QUERY
    spans = [SeqSpan(0, 1, 9, [0, 1, 2]), SeqSpan(1, n + 1, n + 1, list(range(3, 9))), SeqSpan(n + 2, 3, 5, [9, 10])]
    groups = build_attention_metadata(spans, BLOCK, CPU).groups
    assert [g.num_seqs for g in groups] == [2, 1]
    assert groups[0].max_query == 3 and groups[1].causal  # a fresh chunk attends to its own k/v only


@pytest.mark.parametrize("shapes, tables", [
    ([(1, 9), (1, 3)], [[5, 2, 7], [1]]),  # two decode rows, contiguous in the batch
    ([(4, 10), (1, 6), (20, 20)], [[9, 3, 0], [4, 8], [10, 11, 12, 13, 14]]),  # verify, decode, fresh chunk
    ([(18, 23)], [[2, 3, 4, 5, 6, 7]]),  # a chunk with history, consecutive blocks (sliced, not gathered)
    ([(20, 20)], [[0, 1, 2, 3, 4]]),  # one fresh prefill: plain causal SDPA
])
def test_outputs_match_float64_causal_attention(shapes, tables):
    out, ref, _, _ = run_step(shapes, tables)
    assert (out.double() - ref).abs().max() < 1e-5


def test_the_steps_keys_and_values_land_in_the_cache():
    _, _, meta, cache = run_step([(3, 7)], [[6, 2]], seed=3)
    written = cache.k.view(-1, *cache.k.shape[2:])[meta.slot_mapping]
    assert written.abs().sum() > 0 and meta.slot_mapping.tolist() == [2 * BLOCK + 0, 2 * BLOCK + 1, 2 * BLOCK + 2]


def test_a_cache_has_one_layer_cache_per_layer():
    cfg = type("Cfg", (), {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8})()
    layers = KVCacheTensors(cfg, num_blocks=5, block_size=BLOCK, dtype=torch.float32, device=CPU).layers
    assert len(layers) == 3 and layers[0].v.shape == (5, BLOCK, 2, 8) and layers[0].k.shape == (5, BLOCK, 2, 8)


@pytest.mark.skipif(not cpu_kernels.kernels_wanted(),
                    reason="verispec's CPU kernels are off here (no C++ compiler, or VERISPEC_CPU_KERNELS=0)")
def test_layout_needs_whole_vectors():
    assert kernel_layout(torch.device("cpu"), BLOCK_KERNEL, 64)
    assert not kernel_layout(torch.device("cpu"), 8, 64)  # block size
    assert not kernel_layout(torch.device("cpu"), BLOCK_KERNEL, 72)  # head size
    assert not kernel_layout(torch.device("meta"), BLOCK_KERNEL, 64)  # not a CPU

