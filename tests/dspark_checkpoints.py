"""Tiny DSpark / DFlash drafter checkpoints written in the published schema (config.json with
`dflash_config`, safetensors under the exports' names), and a plain reference of their forward:
the whole context recomputed from the HF target's `hidden_states` every time, one dense softmax
attention, fp32 throughout. The engine's drafter (paged context cache, fused projections, slot
by slot sampling) must draft what this reference drafts."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

MASK = 3


def make_dspark_checkpoint(path, target_cfg: dict, *, layers: int = 1, block: int = 4, rank: int = 8,
                           confidence: bool = True, draft_vocab: int | None = None, target_layer_ids=(0, 2),
                           anchor: bool | None = None, top_level: bool = False, prefix: str = "", seed: int = 0,
                           markov: torch.Tensor | None = None, own_head: bool = True) -> str:
    """A random drafter for a target of config `target_cfg`. rank 0: no Markov head; `markov`:
    given [V, V] bias rows (rank V). draft_vocab: a reduced vocabulary, the target's odd ids, with
    its own head rows, or (own_head=False) the target's."""
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = target_cfg["hidden_size"], target_cfg["vocab_size"]
    heads, kv_heads, head_dim, inter = 4, 2, 16, 96
    rand = lambda *shape, s=0.3: (torch.randn(*shape, generator=g) * s).contiguous()  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * torch.randn(n, generator=g)).contiguous()  # noqa: E731
    t = {"fc.weight": rand(hidden, hidden * len(target_layer_ids), s=0.15), "hidden_norm.weight": norm(hidden),
         "norm.weight": norm(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
              p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
              p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
              p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
              p + "mlp.down_proj.weight": rand(hidden, inter)}
    vd = draft_vocab or vocab
    if draft_vocab:
        ids = torch.arange(1, 2 * draft_vocab, 2)[:draft_vocab]
        t["d2t"] = ids - torch.arange(draft_vocab)  # offsets: target id = draft id + d2t[draft id]
        if own_head:
            t["lm_head.weight"] = rand(vd, hidden, s=1.0)
    if markov is not None:
        rank = markov.shape[0]
        t["markov_w1"], t["markov_w2"] = torch.eye(rank), markov.t().contiguous()
    elif rank:
        t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"] = rand(vocab, rank), rand(vd, rank)
    if confidence:
        t["confidence_head.proj.weight"] = rand(1, hidden + rank, s=0.2)
        t["confidence_head.proj.bias"] = torch.tensor([0.5])
    drafter = {"target_layer_ids": list(target_layer_ids), "mask_token_id": MASK}
    cfg = {"architectures": ["DSparkDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "vocab_size": vocab, "max_position_embeddings": 2048, "block_size": block,
           "markov_head_type": "vanilla", "markov_rank": rank, "draft_vocab_size": vd}
    if anchor is not None:
        cfg["sample_from_anchor"] = anchor
    cfg |= drafter if top_level else {"dflash_config": drafter}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({prefix + k: v for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, d):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


@torch.no_grad()
def reference_drafts(ckpt: str, hf_target, tokens: list[int], k: int) -> list[int]:
    """Greedy drafts for a request whose tokens are `tokens` (the last one the anchor, the rest
    computed by the target), by the published math, from scratch."""
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    t = {k2.removeprefix("model."): v.float() for k2, v in load_file(os.path.join(ckpt, "model.safetensors")).items()}
    inner = cfg.get("dflash_config", cfg)
    ids, mask, b = inner["target_layer_ids"], inner["mask_token_id"], cfg["block_size"]
    w1 = t.get("markov_w1", t.get("markov_head.markov_w1.weight"))
    w2 = t.get("markov_w2", t.get("markov_head.markov_w2.weight"))
    first = 0 if cfg.get("sample_from_anchor", w1 is not None or "confidence_head.proj.weight" in t) else 1
    c = len(tokens) - 1
    hs = hf_target(torch.tensor([tokens[:c]]), output_hidden_states=True).hidden_states
    ctx = _rms(torch.cat([hs[i + 1][0] for i in ids], -1) @ t["fc.weight"].t(), t["hidden_norm.weight"])
    embed = hf_target.get_input_embeddings().weight.float()
    x = embed[torch.tensor([tokens[c]] + [mask] * (b - 1))]
    pos = torch.arange(c + b)
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: t[f"layers.{i}.{n}.weight"]  # noqa: E731
        h = _rms(x, p("input_layernorm"))
        both = torch.cat([ctx, h])  # keys and values: the context's, then the block's
        q = _rope(_rms((h @ p("self_attn.q_proj").t()).view(b, nh, d), p("self_attn.q_norm")), pos[c:], d)
        kk = _rope(_rms((both @ p("self_attn.k_proj").t()).view(-1, nkv, d), p("self_attn.k_norm")), pos, d)
        vv = (both @ p("self_attn.v_proj").t()).view(-1, nkv, d)
        kk, vv = kk.repeat_interleave(nh // nkv, 1), vv.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, kk) * d**-0.5, -1)
        x = x + torch.einsum("hqk,khd->qhd", att, vv).reshape(b, nh * d) @ p("self_attn.o_proj").t()
        h = _rms(x, p("post_attention_layernorm"))
        x = x + (torch.nn.functional.silu(h @ p("mlp.gate_proj").t()) * (h @ p("mlp.up_proj").t())) @ p("mlp.down_proj").t()
    h = _rms(x, t["norm.weight"])
    head = hf_target.get_output_embeddings().weight.float()
    if "d2t" in t:
        head = t["lm_head.weight"] if "lm_head.weight" in t else head[torch.arange(len(t["d2t"])) + t["d2t"].long()]
    logits = h @ head.t()
    out, prev = [], tokens[c]
    for j in range(k):
        row = logits[first + j] + (w2 @ w1[prev] if w1 is not None else 0)
        tok = int(row.argmax())
        tok = tok + int(t["d2t"][tok]) if "d2t" in t else tok
        out.append(tok)
        prev = tok
    return out
