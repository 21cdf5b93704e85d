"""The DSpark / DFlash block drafter's network (checkpoints: models/dspark_checkpoint.py).

It reads the target's hidden states and drafts a whole block in one forward:
- context: the outputs of the target layers `target_layer_ids`, concatenated, projected (`fc`) and
  normed (`hidden_norm`), are each context token's features. Every draft layer turns them into
  keys and values with its own k / v projections (k normed, rotated at the token's position), a
  prefix the block attends to. They depend on nothing else, so they are computed once per token,
  as the target computes it, and kept in a cache (`context_kv`);
- block: [anchor, mask x (B - 1)] through the target's embedding, at positions anchor .. anchor +
  B - 1, through the draft's layers. Each block row attends to the whole context and to every row
  of its block (no causal mask), then the final norm;
- heads: the lm head (the target's, or a reduced vocabulary's own rows); the Markov head's bias,
  low rank and keyed on the previous token (W2 W1[prev]); the confidence head, the chance that
  the target accepts the slot's draft given the drafts before it accepted, from the slot's hidden
  state and the previous token's Markov row.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.dspark_checkpoint import DSparkConfig
from verispec.models.gguf_blocks import concat_rows
from verispec.models.linear import make_linear
from verispec.models.llama import RMSNorm, apply_rope, rope_inv_freq, rope_tables


class DraftLayer(nn.Module):
    """A Qwen3-style decoder layer whose attention also reads the context's cached keys and values."""

    def __init__(self, cfg: DSparkConfig, w: dict, index: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        lc, p = cfg.layers, f"layers.{index}."
        linear = partial(make_linear, dtype=dtype, device=device)
        norm = lambda name: RMSNorm(w[p + name].to(device=device, dtype=dtype), lc.rms_norm_eps)  # noqa: E731
        self.num_heads, self.num_kv_heads, self.head_dim = lc.num_heads, lc.num_kv_heads, lc.head_dim
        self.q_size, self.kv_size = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
        self.attn_norm, self.mlp_norm = norm("input_layernorm.weight"), norm("post_attention_layernorm.weight")
        attn = [w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        self.qkv = linear(concat_rows(attn))
        self.o = linear(w[p + "self_attn.o_proj.weight"])
        self.q_norm = norm("self_attn.q_norm.weight") if lc.qk_norm else None
        self.k_norm = norm("self_attn.k_norm.weight") if lc.qk_norm else None
        self.gate_up = linear(concat_rows([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
        self.down = linear(w[p + "mlp.down_proj.weight"])
        self.inter = lc.intermediate_size

    def keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, kv heads, head dim] keys: normed (Qwen3), then rotated."""
        return apply_rope(self.k_norm(k) if self.k_norm is not None else k, cos, sin)

    def forward(self, x: torch.Tensor, cos, sin, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x: [R * B, hidden], R blocks of B rows; ctx_k / ctx_v: [R, C, kv heads, head dim] each
        block's context (padded); mask: [R, 1, 1, C + B] additive, 0 where a key is visible."""
        n, nh, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        r = ctx_k.shape[0]
        qkv = self.qkv(self.attn_norm(x))
        q = qkv[:, : self.q_size].view(n, nh, d)
        k = self.keys(qkv[:, self.q_size : self.q_size + self.kv_size].view(n, nkv, d), cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(n, nkv, d)
        q = apply_rope(self.q_norm(q) if self.q_norm is not None else q, cos, sin)
        b = n // r
        keys = torch.cat([ctx_k, k.view(r, b, nkv, d)], dim=1).transpose(1, 2)
        values = torch.cat([ctx_v, v.view(r, b, nkv, d)], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.view(r, b, nh, d).transpose(1, 2), keys, values, attn_mask=mask,
                                             scale=d**-0.5, enable_gqa=nh != nkv)
        x = self.o.forward_residual(out.transpose(1, 2).reshape(n, self.q_size), x)
        gate_up = self.gate_up(self.mlp_norm(x))
        return self.down.forward_residual(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :], x)


def target_head_rows(target) -> torch.Tensor:
    """The target's lm_head as an fp32 [vocab, hidden] matrix, whatever its format: the head applied
    to the identity (exact: each row of the identity is one 1.0, which every kernel represents)."""
    hidden = target.cfg.hidden_size
    eye = torch.eye(hidden, dtype=target.dtype, device=target.embed.device)
    with torch.inference_mode():
        return target.lm_head(eye).float().t().contiguous()


class DSparkModel(nn.Module):
    def __init__(self, cfg: DSparkConfig, w: dict, target_vocab: int, dtype: torch.dtype, device: torch.device,
                 head_rows=None):
        """head_rows(ids): the target's head rows for those ids, where a reduced vocabulary's
        checkpoint leaves its lm_head out (they are the target's rows)."""
        super().__init__()
        self.cfg = cfg
        lc = cfg.layers
        linear = partial(make_linear, dtype=dtype, device=device)
        self.fc = linear(w["fc.weight"])
        self.hidden_norm = RMSNorm(w["hidden_norm.weight"].to(device=device, dtype=dtype), lc.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, w, i, dtype, device) for i in range(lc.num_layers))
        self.norm = RMSNorm(w["norm.weight"].to(device=device, dtype=dtype), lc.rms_norm_eps)
        # Every layer's context keys and values in one matmul: one weight read per context token.
        self.context_proj = linear(concat_rows([w[f"layers.{i}.self_attn.{x}_proj.weight"]
                                                for i in range(lc.num_layers) for x in "kv"]))
        inv_freq, factor = rope_inv_freq(lc)
        self.register_buffer("inv_freq", inv_freq[None].to(device), persistent=False)
        self.rope_scale = None if factor == 1.0 else torch.tensor(factor, device=device)
        # A reduced vocabulary's own head rows and its map to target ids; None: the target's head.
        reduced = cfg.draft_vocab_size != target_vocab  # else lm_head, if any, is the target's copy
        self.d2t = ((torch.arange(cfg.draft_vocab_size) + w["d2t"].long()).to(device) if reduced else None)
        self.lm_head = None
        if reduced:
            rows = w["lm_head.weight"] if "lm_head.weight" in w else head_rows(self.d2t)
            self.lm_head = linear(rows, head=True)
        self.markov_w1 = self.markov_w2 = None
        if cfg.markov_rank:
            self.markov_w1 = nn.Parameter(w["markov_w1.weight"].to(device=device, dtype=dtype), requires_grad=False)
            self.markov_w2 = linear(w["markov_w2.weight"])
        self.confidence = None  # (weight [1, in], bias [1]), fp32 as the head was trained
        if cfg.confidence_head:
            self.confidence = (w["confidence_head.proj.weight"].float().to(device),
                               w.get("confidence_head.proj.bias", torch.zeros(1)).float().to(device))
        self.dtype = dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_tables(positions, self.inv_freq, self.rope_scale, self.dtype)
        return cos[0], sin[0]

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context keys and values [T, kv heads, head dim] of T target tokens from
        their captured hidden states [T, len(target_layer_ids) * target hidden]."""
        c = self.hidden_norm(self.fc(features.to(self.dtype)))
        lay = self.layers[0]
        nkv, d = lay.num_kv_heads, lay.head_dim
        kv = self.context_proj(c).view(c.shape[0], len(self.layers), 2, nkv, d)
        cos, sin = self.rope(positions)
        return [(layer.keys(kv[:, i, 0], cos, sin), kv[:, i, 1]) for i, layer in enumerate(self.layers)]

    def block(self, embeds: torch.Tensor, positions: torch.Tensor,
              context: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> torch.Tensor:
        """The blocks' final hidden states [R * B, hidden] from their rows' embeddings."""
        x = embeds.to(self.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        cos, sin = self.rope(positions)
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, target_logits) -> torch.Tensor:
        """fp32 logits over the drafter's vocabulary; `target_logits`: the target's head."""
        out = (self.lm_head(hidden) if self.lm_head is not None else target_logits(hidden)).float()
        if self.cfg.output_multiplier != 1.0:
            out = out * self.cfg.output_multiplier
        cap = self.cfg.final_softcap
        return torch.tanh(out / cap) * cap if cap else out

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor | None:
        """[N, draft vocab] fp32 bias after target tokens `prev`; None without a Markov head."""
        if self.markov_w1 is None:
            return None
        return self.markov_w2(self.markov_w1[prev]).float()

    def accept_chance(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """[N] the confidence head's chance that each slot's draft is accepted; None without one."""
        if self.confidence is None:
            return None
        x = hidden.float()
        if self.cfg.confidence_with_markov:
            x = torch.cat([x, self.markov_w1[prev].float()], dim=-1)
        return torch.sigmoid(F.linear(x, *self.confidence)[:, 0])

    def to_target_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Draft-vocabulary logits [N, Vd] as target-vocabulary ones [N, V], -inf outside it."""
        if self.d2t is None:
            return logits
        full = logits.new_full((logits.shape[0], vocab), float("-inf"))
        return full.index_copy_(1, self.d2t, logits)
