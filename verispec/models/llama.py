"""The decoder forward of every family verispec runs (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3, Phi-3 / Phi-4) over a flat batch of tokens; models/architectures.py says which family
uses which feature (sandwich norms, GeGLU, scaled embeddings, soft-capping, sliding windows, a
second RoPE base, partial rotary, LongRoPE).

Linear layers come from `make_linear` (verispec.models.linear): dense, or quantized and packed
for the int4 kernels. The layer code never knows which.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.architectures import family
from verispec.models.attention import AttentionMetadata, attention, attention_context, enter_layer
from verispec.models.kv_cache_tensors import KVCacheTensors
from verispec.models.config import ModelConfig
from verispec.models.cpu_kernels import cpu_kernels_available
from verispec.models.gguf_blocks import concat_rows, dequantize, is_quantized
from verispec.models.linear import make_linear, packed_wanted
from verispec.models.quant import QuantizedWeight


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        # On a CPU: verispec's op, one order of arithmetic in the compiled graph and eager alike
        # (Inductor's own reduction rounds some rows differently: batch invariance).
        self.fixed_order = (weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
                            and weight.device.type == "cpu" and cpu_kernels_available())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_order:
            return torch.ops.verispec_cpu.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op; bit-identical to the expanded form in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 whatever the weights are, round, then scale, as the reference
        # implementation does; the fused fp32 op is bit-identical to its expanded form.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies over the rotated dims, the factor on cos and sin). local: the sliding
    layers' own unscaled base (Gemma 3)."""
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if local:
        return 1.0 / (cfg.rope_local_theta**exponents), 1.0
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "longrope":
        return _longrope(cfg, scaling, exponents)
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
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3, longrope)")


def _longrope(cfg: ModelConfig, scaling: dict, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency factors, the long ones where the engine's context passes the
    original one (as llama.cpp chooses: one choice per engine, so a cached key never changes), and
    cos / sin scaled by sqrt(1 + ln(factor) / ln(original)) unless the config names the factor."""
    original = int(scaling["original_max_position_embeddings"])
    context = cfg.rope_context or cfg.max_position_embeddings
    factors = scaling["long_factor"] if context > original else scaling["short_factor"]
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * cfg.rope_theta**exponents)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling.get("factor") or cfg.max_position_embeddings / original
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention_factor)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scale: torch.Tensor | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [tables, T, 1, rotary dims], for inverse frequencies [tables, dims / 2]; the
    sin with rotate_half's sign folded in (`apply_rope`)."""
    freqs = positions.float()[None, :, None] * inv_freq[:, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    s = freqs.sin()
    sin = torch.cat((-s, s), dim=-1)[:, :, None, :]
    cos = emb.cos()
    if scale is not None:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's sign folded into signed_sin (negation is
    exact, so the result is bit-identical) to save an op per layer. Tables narrower than the head
    rotate its first dims and pass the rest (partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, signed_sin), x[..., rot:]), dim=-1)
    half = rot // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict, index: int, dtype: torch.dtype, device: torch.device, parallel=None):
        super().__init__()
        prefix, self.index, self.parallel = f"layers.{index}.", index, parallel
        get = lambda name: w.get(prefix + name)  # noqa: E731
        linear = lambda weight, bias=None: make_linear(weight, dtype, device, bias)  # noqa: E731
        norm = lambda name: RMSNorm(w[prefix + name].to(device=device, dtype=dtype), cfg.rms_norm_eps)  # noqa: E731
        fam = family(cfg.architecture)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = (cfg.query_scalar or cfg.head_dim) ** -0.5
        self.window, self.softcap = cfg.window(index), float(cfg.attn_softcap or 0.0)
        # Gemma 3's sliding layers rotate with a base of their own: the model's second table.
        self.rope_table = 1 if self.window and cfg.rope_local_theta else 0
        self.attn_norm, self.mlp_norm = norm("attn_norm"), norm("mlp_norm")
        # Gemma 2 / 3 also norm the attention's and the MLP's outputs before the residual.
        self.post_attn_norm = norm("post_attn_norm") if fam.sandwich_norms else None
        self.post_mlp_norm = norm("post_mlp_norm") if fam.sandwich_norms else None
        # q, k and v in one matmul: one weight read per layer instead of three.
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([get("q_bias"), get("k_bias"), get("v_bias")])
        self.qkv = linear(concat_rows([get("q"), get("k"), get("v")]), bias)
        self.o = linear(get("o"))
        self.q_norm = norm("q_norm") if cfg.qk_norm else None
        self.k_norm = norm("k_norm") if cfg.qk_norm else None
        self.gate_up = linear(concat_rows([get("gate"), get("up")]))
        self.down = linear(get("down"))
        self.act = partial(F.gelu, approximate="tanh") if fam.activation == "gelu_tanh" else F.silu
        self.inter = cfg.intermediate_size
        self.o_rows = self.down_rows = cfg.hidden_size

    def forward(self, x, cos, sin):
        """x [T, hidden] -> [T, hidden]; cos and sin are the model's tables, [tables, T, 1, dims],
        of which the layer rotates with its own. The attention context says which layer's cache
        it reads (`enter_layer`): the layer's index is no constant of a compiled layer."""
        cos, sin = cos[self.rope_table], sin[self.rope_table]
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv(self.attn_norm(x))
        qk = qkv[:, : self.q_size + self.kv_size].view(t, nh + nkv, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, nkv, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        # q and k rotate together: one set of elementwise ops per layer instead of two.
        qk = apply_rope(qk, cos, sin)
        attn = attention(qk[:, :nh], qk[:, nh:], v, self.scale, self.window, self.softcap)
        x = self._residual(self.o, attn.reshape(t, self.q_size), x, self.post_attn_norm)
        gate_up = self.gate_up(self.mlp_norm(x))
        return self._residual(self.down, self.act(gate_up[:, : self.inter]) * gate_up[:, self.inter :], x,
                              self.post_mlp_norm)

    def _residual(self, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, post_norm) -> torch.Tensor:
        """residual + x @ W_t (normed first where the family norms outputs); under tensor
        parallelism each rank holds some of W's input columns, and the partial products are summed
        across ranks before the norm and the residual (once)."""
        if self.parallel is None and post_norm is None:
            return linear.forward_residual(x, residual)
        out = linear(x) if self.parallel is None else self.parallel.group.all_reduce(linear(x))
        return residual + (out if post_norm is None else post_norm(out))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: dict, num_layers: int | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu", parallel=None):
        """weights: dense tensors and/or `QuantizedWeight`s; dense ones are cast to `dtype`
        (default: the embedding's), quantized ones are packed on `device` for its kernels.

        parallel (a `verispec.distributed.sharding.ShardContext`): cfg and weights are this rank's
        shard (verispec.distributed.sharding), and the forward runs the collectives."""
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        n = cfg.num_layers if num_layers is None else num_layers
        missing = [k for k in ("embed", "norm") if k not in weights]
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing}")
        embed = weights["embed"]
        dtype = dtype or (torch.bfloat16 if is_quantized(embed) else embed.dtype)
        device = torch.device(device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, weights, i, dtype, device, parallel) for i in range(n))
        self.norm = RMSNorm(weights["norm"].to(device=device, dtype=dtype), cfg.rms_norm_eps)
        # Token lookups read a tied head's packed rows where it runs packed (`PackedLinear.rows`):
        # no dense table beside it. Otherwise a quantized table is dequantized once (exact values).
        tied = cfg.tie_word_embeddings or "lm_head" not in weights
        rows_of_head = tied and parallel is None and is_quantized(embed) and packed_wanted(embed, dtype, device)
        table = torch.empty(0, cfg.hidden_size) if rows_of_head else dequantize(embed) if is_quantized(embed) else embed
        self.embed = nn.Parameter(table.to(device=device, dtype=dtype), requires_grad=False)
        self.lm_head = self.make_head(embed, weights.get("lm_head"))
        # The quantized matrices as loaded: an update of one part of a fused matrix (q of q|k|v)
        # re-packs it with the others' codes (verispec/models/weights.py).
        self.sources = {name: w for name, w in weights.items() if is_quantized(w)}
        # One RoPE table per base: the model's, and Gemma 3's sliding layers' own.
        tables = [rope_inv_freq(cfg)] + ([rope_inv_freq(cfg, local=True)] if cfg.rope_local_theta else [])
        self.register_buffer("inv_freq", torch.stack([f for f, _ in tables]).to(device), persistent=False)
        # LongRoPE scales cos and sin: a buffer, so a step copies nothing from the host.
        factors = torch.tensor([factor for _, factor in tables])[:, None, None, None]
        self.register_buffer("rope_scale", None if bool((factors == 1).all()) else factors.to(device), persistent=False)
        # Gemma scales its embeddings by sqrt(hidden), rounded to the model's dtype as it does.
        fam = family(cfg.architecture)
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype)) if fam.embed_scale else None
        self.compiled = None  # set by verispec.models.compile
        self.eager_pieces = [(i, (layer,), None) for i, layer in enumerate(self.layers)]
        # Layers whose outputs a hidden-state drafter reads (spec_decode/dspark_drafter.py): set before the
        # graph is compiled, as the graph returns them. Each forward keeps them in `captured`.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def make_head(self, embed, lm_head) -> nn.Module:
        """The lm_head: its own matrix, or the embedding's when tied (or absent)."""
        tied = self.cfg.tie_word_embeddings or lm_head is None
        if tied and isinstance(embed, QuantizedWeight) and self.embed.numel():
            # Past the kernels' rows (prefill-sized batches) the dense table, already in memory for
            # the lookup, replaces dequantizing 28M weights.
            return make_linear(embed, self.dtype, self.embed.device, head=True, dense=self.embed)
        return make_linear(embed if tied else lm_head, self.dtype, self.embed.device, head=True)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables, [tables, T, 1, rotary dims] (broadcast over heads)."""
        return rope_tables(positions, self.inv_freq, self.rope_scale, self.dtype)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches, num_layers: int | None = None):
        """Hidden states after the final norm, [T, hidden], for every token of the flat batch.

        num_layers runs only the first layers (then the final norm): the layer-skip drafter."""
        with attention_context(meta, kv_caches):
            # The rotary tables are computed eager on both paths: Inductor's sin and cos round
            # some positions differently from ATen's, and a row must compute alike on both.
            cos, sin = self.rope(positions)
            out = self.stack(input_ids, cos, sin, num_layers)
        if self.capture_layers and num_layers is None:
            out, self.captured = out
        return out

    def stack(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              num_layers: int | None = None) -> torch.Tensor:
        """Embedding, layers, final norm. The layers run in pieces: compiled graphs of consecutive
        layers where they are ready and the step is short enough (models/compile.py), else one
        layer at a time, eager: the same bits either way."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        capture = self.capture_layers if num_layers is None else ()
        end = len(self.layers) if num_layers is None else num_layers
        pieces = self.compiled.for_step(input_ids) if self.compiled is not None else None
        captured = {}
        for start, layers, graph in pieces or self.eager_pieces:
            if start >= end:
                break
            enter_layer(start)  # each attention call moves on to the next layer's cache
            if graph is not None and start + len(layers) <= end:
                outs = graph(layers, x, cos, sin)  # every layer's output where a drafter reads some
                x = outs[-1]
                captured.update((start + i, out) for i, out in enumerate(outs) if start + i in capture)
            else:
                for i, layer in enumerate(layers[: end - start]):
                    x = layer(x, cos, sin)
                    if start + i in capture:
                        captured[start + i] = x
        x = self.norm(x)
        if not capture:
            return x
        # In the drafter's order (never the last layer: models/dspark_checkpoint.py refuses it).
        return x, torch.cat([captured[i] for i in capture], dim=-1)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.embed.numel():  # the tied head's packed rows
            return self.lm_head.rows(input_ids, self.dtype)
        if self.parallel is None:
            return F.embedding(input_ids, self.embed)
        # Vocabulary-parallel: each rank looks up the ids in its rows and zeros the others; the
        # sum across ranks adds exact zeros, so every row is the one table's row, bit for bit.
        local = input_ids - self.parallel.shard.vocab[0]
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill_(outside[:, None], 0)
        return self.parallel.group.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, vocab] logits. Under tensor parallelism each rank computes its vocabulary columns
        and rank 0 gathers the whole row (see docs/scaling.md for why not a sharded softmax)."""
        logits = self.lm_head(hidden)
        if self.parallel is not None:
            logits = self.parallel.group.gather_columns(logits, self.parallel.vocab_widths)
        cap = self.cfg.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def new_kv_cache(self, num_blocks: int, block_size: int):
        """Cache tensors for this model (this rank's KV heads under tensor parallelism)."""
        return KVCacheTensors(self.cfg, num_blocks, block_size, self.dtype, self.embed.device)
