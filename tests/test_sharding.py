"""Tensor-parallel sharding as pure functions: every head, column and vocabulary row held exactly
where the forward expects it, and the shards put back together give the checkpoint."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verispec.distributed.sharding import head_split, make_shard, max_kv_heads_per_rank, shard_checkpoint
from verispec.models.config import ModelConfig
from verispec.models.quant import QuantizedWeight, quantize_rtn


def _cfg(num_heads=9, num_kv_heads=3, inter=1536, vocab=49152, head_dim=64, hidden=576) -> ModelConfig:
    return ModelConfig("llama", vocab, hidden, inter, 1, num_heads, num_kv_heads, head_dim, 1e-5, 1e4, 512, True)


@st.composite
def head_layouts(draw):
    kv = draw(st.integers(1, 8))
    group = draw(st.integers(1, 6))
    size = draw(st.sampled_from([s for s in range(1, 9) if s <= kv or (s % kv == 0 and group >= s // kv)]))
    return kv * group, kv, size


@given(head_layouts())
def test_every_query_head_is_computed_once_next_to_its_kv_head(layout):
    num_heads, num_kv, size = layout
    group = num_heads // num_kv
    owners = []
    for rank in range(size):
        (q0, q1), (k0, k1) = head_split(num_heads, num_kv, size, rank)
        assert q1 > q0 and k1 > k0, "every rank computes something"
        assert all(k0 <= h // group < k1 for h in range(q0, q1)), "a query head's KV head lives on its rank"
        # A rank's local GQA layout must be the model's: its query heads fill whole local groups.
        assert (q1 - q0) % (k1 - k0) == 0
        owners += range(q0, q1)
    assert sorted(owners) == list(range(num_heads))


@pytest.mark.parametrize("num_heads, num_kv, size, expected", [
    (9, 3, 2, [((0, 6), (0, 2)), ((6, 9), (2, 3))]),  # SmolLM2: uneven, whole KV groups
    (4, 1, 2, [((0, 2), (0, 1)), ((2, 4), (0, 1))]),  # MQA: the KV head replicated
    (8, 2, 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),
])
def test_head_split_examples(num_heads, num_kv, size, expected):
    assert [head_split(num_heads, num_kv, size, r) for r in range(size)] == expected


def test_sizes_that_cannot_split_name_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        head_split(4, 2, 3, 0)
    with pytest.raises(ValueError, match="without a query head"):
        head_split(2, 1, 4, 0)


def test_intermediate_and_vocabulary_splits_cover_everything_and_keep_quant_groups_whole():
    cfg = _cfg(inter=1536 + 32, vocab=49153)
    shards = [make_shard(cfg, 3, r) for r in range(3)]
    assert [s.inter for s in shards][0][0] == 0 and shards[-1].inter[1] == cfg.intermediate_size
    assert all(a.inter[1] == b.inter[0] for a, b in zip(shards, shards[1:]))
    assert all(s.inter[0] % 32 == 0 for s in shards)
    assert shards[0].vocab[0] == 0 and shards[-1].vocab[1] == cfg.vocab_size
    assert all(a.vocab[1] == b.vocab[0] for a, b in zip(shards, shards[1:]))
    assert max_kv_heads_per_rank(cfg, 2) == 2


def _layer_weights(cfg: ModelConfig, quantized: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    d, h = cfg.head_dim, cfg.hidden_size
    shapes = {"q": (cfg.num_heads * d, h), "k": (cfg.num_kv_heads * d, h), "v": (cfg.num_kv_heads * d, h),
              "o": (h, cfg.num_heads * d), "gate": (cfg.intermediate_size, h), "up": (cfg.intermediate_size, h),
              "down": (h, cfg.intermediate_size)}
    w = {f"layers.0.{n}": torch.randn(*s, generator=g) for n, s in shapes.items()}
    w |= {"layers.0.q_bias": torch.randn(cfg.num_heads * d, generator=g), "layers.0.attn_norm": torch.randn(h, generator=g),
          "embed": torch.randn(cfg.vocab_size, h, generator=g), "norm": torch.randn(h, generator=g)}
    if quantized:
        w = {k: quantize_rtn(v, 4) if v.dim() == 2 else v for k, v in w.items()}
    return w


def _dense(w):
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("size", [2, 3])
def test_shards_reassemble_the_checkpoint(quantized, size):
    cfg = _cfg(num_heads=6, num_kv_heads=3, inter=192, vocab=100, head_dim=16, hidden=64)
    weights = _layer_weights(cfg, quantized)
    parts = [shard_checkpoint(cfg, weights, make_shard(cfg, size, r)) for r in range(size)]
    for name, w in weights.items():
        pieces = [_dense(p[1][name]) for p in parts]
        leaf = name.rsplit(".", 1)[-1]
        dim = 1 if leaf in ("o", "down") else 0
        whole = torch.cat(pieces, dim) if leaf not in ("attn_norm", "norm") else pieces[0]
        assert torch.equal(whole, _dense(w)), name
        if quantized and leaf in ("o", "down"):  # the cut falls between whole groups: still codes
            assert all(isinstance(p[1][name], QuantizedWeight) for p in parts)
    local = [p[0] for p in parts]
    assert sum(c.num_heads for c in local) == cfg.num_heads
    assert sum(c.vocab_size for c in local) == cfg.vocab_size
