"""Llama-family forward (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

Linear layers are small modules holding their weight transposed ([in, out]): on this CPU class
`x @ W_t` beats `F.linear(x, W)` by up to 2x for the skinny decode shapes (measured, see
docs/design.md). A tensor-parallel variant replaces `Linear` without touching the layer code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.attention import AttentionMetadata, paged_attention
from verispec.models.config import ModelConfig


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W_t in one fused op (no bias: o and down projections have none)."""
        return torch.addmm(residual, x, self.weight_t)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; bit-identical to the expanded form in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 whatever the weights are, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        get = lambda name: w.get(prefix + name)  # noqa: E731
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.attn_norm = RMSNorm(get("attn_norm"), cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(get("mlp_norm"), cfg.rms_norm_eps)
        # q, k and v in one matmul: one weight read per layer instead of three.
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([get("q_bias"), get("k_bias"), get("v_bias")])
        self.qkv = Linear(torch.cat([get("q"), get("k"), get("v")]), bias)
        self.o = Linear(get("o"))
        self.q_norm = RMSNorm(get("q_norm"), cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(get("k_norm"), cfg.rms_norm_eps) if cfg.qk_norm else None
        self.gate_up = Linear(torch.cat([get("gate"), get("up")]))
        self.down = Linear(get("down"))
        self.inter = cfg.intermediate_size

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv(self.attn_norm(x))
        qk = qkv[:, : self.q_size + self.kv_size].view(t, nh + nkv, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, nkv, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        # q and k rotate together: one set of elementwise ops per layer instead of two.
        qk = apply_rope(qk, cos, sin)
        attn = paged_attention(qk[:, :nh], qk[:, nh:], v, kv_cache[0], kv_cache[1], meta, self.scale)
        x = self.o.forward_residual(attn.reshape(t, self.q_size), x)
        gate_up = self.gate_up(self.mlp_norm(x))
        return self.down.forward_residual(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :], x)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], num_layers: int | None = None):
        super().__init__()
        self.cfg = cfg
        n = cfg.num_layers if num_layers is None else num_layers
        missing = [k for k in ("embed", "norm") if k not in weights]
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing}")
        self.embed = nn.Parameter(weights["embed"], requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, weights, f"layers.{i}.") for i in range(n))
        self.norm = RMSNorm(weights["norm"], cfg.rms_norm_eps)
        head = weights["embed"] if cfg.tie_word_embeddings or "lm_head" not in weights else weights["lm_head"]
        self.lm_head = Linear(head)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D], broadcast over heads
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches, num_layers: int | None = None):
        """Hidden states after the final norm, [T, hidden], for every token of the flat batch.

        num_layers runs only the first layers (then the final norm): the layer-skip drafter."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(positions)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer, cache in zip(layers, kv_caches):
            x = layer(x, cos, sin, meta, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
