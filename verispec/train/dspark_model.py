"""A DSpark drafter as it trains: the same network as models/dspark.py, with gradients, over many
blocks of many sequences at once, and its export in the published checkpoint schema.

A training batch packs S sequences (padded to the longest) and A anchors in each. The block of
anchor p is [token p, mask x (B - 1)] at positions p .. p + B - 1; it sees the context positions
before p and its own rows, as at inference. Slot k predicts token p + k + 1 (DSpark's layout).

Losses, per slot weighted by exp(-k / 4) and only over a contiguous run of real labels:
- 0.1 x cross-entropy on the token the target wrote (its own answer);
- 0.9 x the L1 distance between the drafter's and the target's next-token distributions (the
  target's top entries, mapped into the draft vocabulary): 1 - acceptance at temperature 1;
- 1.0 x binary cross-entropy of the confidence head against the chance of acceptance,
  sum(min(p_draft, p_target)), detached.
The Markov head is teacher-forced: slot k's previous token is the true token p + k.
The embedding and the draft vocabulary's head rows are the target's, frozen.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CE_WEIGHT, TV_WEIGHT, CONF_WEIGHT = 0.1, 0.9, 1.0
SLOT_DECAY = 4.0


@dataclass(frozen=True)
class DrafterShape:
    """What to build; the target's widths (heads, MLP) are reused for the draft layers."""

    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_layers: int = 1
    block_size: int = 8
    markov_rank: int = 64
    hidden_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_size: int = 0


class _Layer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        h, d = s.hidden_size, s.head_dim
        self.input_layernorm = nn.RMSNorm(h, eps=s.rms_norm_eps)
        self.q_proj = nn.Linear(h, s.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(s.num_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=s.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=s.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=s.rms_norm_eps)
        self.gate_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, h, bias=False)
        self.shape = s

    def context(self, c: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        k = self.k_proj(c).unflatten(-1, (s.num_kv_heads, s.head_dim))
        return _rotate(self.k_norm(k), cos, sin), self.v_proj(c).unflatten(-1, (s.num_kv_heads, s.head_dim))

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x [S, R, H]; ctx_k / ctx_v [S, T, kv heads, d]; mask [S, 1, R, T + R] (True: visible)."""
        s = self.shape
        h = self.input_layernorm(x)
        q = _rotate(self.q_norm(self.q_proj(h).unflatten(-1, (s.num_heads, s.head_dim))), cos, sin)
        k, v = self.context(h, cos, sin)
        keys = torch.cat([ctx_k, k], dim=1).transpose(1, 2)
        values = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=s.num_heads != s.num_kv_heads)
        x = x + self.o_proj(out.transpose(1, 2).flatten(2))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


# Each trained layer part under its name in the exports.
_LAYER_NAMES = {"input_layernorm": "", "post_attention_layernorm": "", "q_proj": "self_attn.", "k_proj": "self_attn.",
                "v_proj": "self_attn.", "o_proj": "self_attn.", "q_norm": "self_attn.", "k_norm": "self_attn.",
                "gate_proj": "mlp.", "up_proj": "mlp.", "down_proj": "mlp."}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class TrainableDSpark(nn.Module):
    def __init__(self, shape: DrafterShape, embed: torch.Tensor, draft_ids: torch.Tensor,
                 head: torch.Tensor | None = None):
        """embed: the target's [V, H] embedding; head: its [V, H] lm_head (default: the embedding,
        tied); draft_ids: the target ids of the draft vocabulary, [Vd]. The export leaves the
        head's rows out: the engine takes them from the target."""
        super().__init__()
        s, h = shape, shape.hidden_size
        self.shape = s
        self.fc = nn.Linear(len(s.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=s.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.num_layers))
        self.norm = nn.RMSNorm(h, eps=s.rms_norm_eps)
        self.markov_w1 = nn.Embedding(s.vocab_size, s.markov_rank)
        self.markov_w2 = nn.Linear(s.markov_rank, len(draft_ids), bias=False)
        self.confidence = nn.Linear(h + s.markov_rank, 1)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        nn.init.normal_(self.markov_w1.weight)  # unit rows: w2's steps move the bias at once
        nn.init.zeros_(self.markov_w2.weight)  # the Markov bias starts at nothing
        nn.init.zeros_(self.confidence.bias)
        # Each context feature's scale, divided out before `fc` and folded into it at export: the
        # target's residual stream has a few dims a hundred times the others (SmolLM2: RMS 1700
        # against a median of 5-17), and under Adam those dims' weights swung `fc`'s output.
        self.register_buffer("feature_scale", torch.ones(len(s.target_layer_ids) * h))
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("head", (embed if head is None else head)[draft_ids].float(), persistent=False)
        self.register_buffer("draft_ids", draft_ids.long(), persistent=False)
        t2d = torch.full((s.vocab_size,), -1, dtype=torch.long)
        t2d[draft_ids] = torch.arange(len(draft_ids))
        self.register_buffer("t2d", t2d, persistent=False)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = positions.float()[..., None] * self.inv_freq
        f = torch.cat([f, f], dim=-1)[..., None, :]  # broadcast over heads
        return f.cos(), f.sin()

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The weighted loss and its parts for a packed batch (trainer.make_batch)."""
        logits, chance_logit = self.block_logits(batch)
        return self._losses(logits, chance_logit, batch)

    def block_logits(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block row's draft-vocabulary logits, Markov bias included, [S, A * B, Vd], and its
        confidence logit [S, A * B]."""
        s = self.shape
        feats, ids, anchors = batch["features"].float(), batch["ids"], batch["anchors"]
        n_seq, t_max = ids.shape
        b = s.block_size
        c = self.hidden_norm(self.fc(feats / self.feature_scale))
        cos, sin = self.rope(torch.arange(t_max))
        block_pos = (anchors[:, :, None] + torch.arange(b)).flatten(1)  # [S, A * B]
        block_ids = torch.full_like(block_pos, s.mask_token_id)
        block_ids.view(n_seq, -1, b)[:, :, 0] = ids.gather(1, anchors)
        x = self.embed[block_ids]
        bcos, bsin = self.rope(block_pos)
        for layer in self.layers:
            k, v = layer.context(c, cos, sin)
            x = layer(x, bcos, bsin, k, v, batch["mask"])
        hidden = self.norm(x)  # [S, A * B, H]
        prev = ids.gather(1, block_pos.clamp(max=t_max - 1))  # slot k reads the true token p + k
        logits = hidden @ self.head.t() + self.markov_w2(self.markov_w1(prev))
        chance_logit = self.confidence(torch.cat([hidden, self.markov_w1(prev)], dim=-1))[..., 0]
        return logits, chance_logit

    def _losses(self, logits, chance_logit, batch) -> tuple[torch.Tensor, dict]:
        weight = batch["weight"]  # [S, A * B]: the slot's decay where its label is real, else 0
        total = weight.sum().clamp(min=1e-6)
        logp = logits.log_softmax(dim=-1)
        label = self.t2d[batch["labels"].clamp(min=0)]
        known = (label >= 0) & (weight > 0)
        ce = -(logp.gather(-1, label.clamp(min=0)[..., None])[..., 0] * known).mul(weight).sum() / total
        target = torch.zeros_like(logp)
        tid = self.t2d[batch["top_ids"].long()]  # [S, A * B, k] draft ids, -1 outside
        target.scatter_add_(-1, tid.clamp(min=0), batch["top_probs"].float() * (tid >= 0))
        p = logp.exp()
        tv = ((p - target).abs().sum(-1) * weight).sum() / total
        accept = torch.minimum(p, target).sum(-1).detach()
        conf = (F.binary_cross_entropy_with_logits(chance_logit, accept, reduction="none") * weight).sum() / total
        loss = CE_WEIGHT * ce + TV_WEIGHT * tv + CONF_WEIGHT * conf
        with torch.no_grad():
            top1 = ((logp.argmax(-1) == label) & known).float().mul(weight).sum() / total
        parts = {"ce": ce.item(), "tv": tv.item(), "conf": conf.item(), "accept": (accept * weight).sum().item()
                 / total.item(), "top1": top1.item()}
        return loss, parts

    def export(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """The published schema (models/dspark_checkpoint.py), in `dtype` (the confidence bias fp32)."""
        from safetensors.torch import save_file

        s, path = self.shape, Path(path)
        path.mkdir(parents=True, exist_ok=True)
        t = {"fc.weight": self.fc.weight / self.feature_scale, "hidden_norm.weight": self.hidden_norm.weight,
             "norm.weight": self.norm.weight, "markov_head.markov_w1.weight": self.markov_w1.weight,
             "markov_head.markov_w2.weight": self.markov_w2.weight,
             "confidence_head.proj.weight": self.confidence.weight}
        for i, layer in enumerate(self.layers):
            for name, group in _LAYER_NAMES.items():
                t[f"layers.{i}.{group}{name}.weight"] = getattr(layer, name).weight
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in t.items()}
        tensors["confidence_head.proj.bias"] = self.confidence.bias.detach().float()
        tensors["d2t"] = self.draft_ids - torch.arange(len(self.draft_ids))
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(_config(s, len(self.draft_ids)), indent=2))


@torch.no_grad()
def start_from(drafter: TrainableDSpark, final_norm: torch.Tensor, features: list[torch.Tensor]) -> None:
    """Before the first step: each context feature's scale, its root mean square over the data's
    tokens; and the target's final norm weights as the drafter's, so that its logits start at the
    target's scale (Adam moves a norm weight by about the learning rate a step)."""
    total, count = 0.0, 0
    for f in features:
        total = total + f.float().pow(2).sum(0)
        count += f.shape[0]
    drafter.feature_scale.copy_((total / max(1, count)).sqrt().clamp(min=1e-3))
    drafter.norm.weight.copy_(final_norm.float())


def _config(s: DrafterShape, draft_vocab: int) -> dict:
    return {"architectures": ["DSparkDraftModel"], "model_type": "qwen3", "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
            "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta, "vocab_size": s.vocab_size,
            "max_position_embeddings": 8192, "block_size": s.block_size, "markov_head_type": "vanilla",
            "markov_rank": s.markov_rank, "draft_vocab_size": draft_vocab, "enable_confidence_head": True,
            "confidence_head_with_markov": True, "sample_from_anchor": True,
            "dflash_config": {"target_layer_ids": list(s.target_layer_ids), "mask_token_id": s.mask_token_id},
            "verispec_shape": asdict(s)}


def slot_weights(block_size: int) -> torch.Tensor:
    return torch.tensor([math.exp(-k / SLOT_DECAY) for k in range(block_size)])
