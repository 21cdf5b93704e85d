"""The model families verispec runs: what each one's forward does differently, and its tensors'
names in HF checkpoints and in GGUF files, in one table. A new family of the same decoder shape is
an entry here; only a forward feature no family has yet needs code in models/llama.py.

Names map to verispec's own (`embed`, `layers.{i}.q`, ..., `norm`, `lm_head`). A fused tensor of a
checkpoint (Phi-3's qkv_proj and gate_up_proj) maps to its parts, in row order; the model fuses
q|k|v and gate|up again itself, whatever the file did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# HF per-layer names shared by every family -> ours (a tuple: a fused tensor's parts, in row order).
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
_GGUF_LAYER = {
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_output.weight": "o",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
_HF_TOP = {"embed_tokens.weight": "embed", "norm.weight": "norm", "lm_head.weight": "lm_head"}
_GGUF_TOP = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}

# Gemma 2 / 3: a norm before and after attention and before and after the MLP ("sandwich").
_GEMMA_HF = {
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
_GEMMA_GGUF = {"post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_mlp_norm"}
# Phi-3 / Phi-4: q|k|v and gate|up fused in the checkpoint.
_PHI3_HF = {"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")}
_PHI3_GGUF = {"attn_qkv.weight": ("q", "k", "v"), "ffn_up.weight": ("gate", "up")}


@dataclass(frozen=True)
class Family:
    name: str  # verispec's name, also ModelConfig.architecture
    hf_types: tuple[str, ...]  # config.json model_type values
    gguf_arch: str  # general.architecture of a GGUF file
    activation: str = "silu"  # of the gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # a norm on the attention's and the MLP's outputs too
    norm_plus_one: bool = False  # HF stores w and the norm scales by 1 + w (GGUF files store 1 + w)
    embed_scale: bool = False  # embeddings scaled by sqrt(hidden), rounded to the model's dtype
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    attention_bias: bool = False  # q, k and v carry a bias
    permuted_qk: bool = False  # GGUF q/k rows in llama.cpp's interleaved rotary order
    swa_pattern: int = 0  # every n-th layer global, the others sliding, where the config lists no layer_types
    hf_layer: dict = field(default_factory=dict)  # per-layer names beyond (or instead of) the common ones
    gguf_layer: dict = field(default_factory=dict)

    def hf_name(self, rest: str):
        return self.hf_layer.get(rest, _HF_LAYER.get(rest))

    def gguf_name(self, rest: str):
        return self.gguf_layer.get(rest, _GGUF_LAYER.get(rest))


FAMILIES = (
    Family("llama", ("llama",), "llama", permuted_qk=True),
    Family("mistral", ("mistral",), "mistral", permuted_qk=True),
    Family("qwen2", ("qwen2",), "qwen2", attention_bias=True),
    Family("qwen3", ("qwen3",), "qwen3", qk_norm=True),
    Family("gemma2", ("gemma2",), "gemma2", activation="gelu_tanh", sandwich_norms=True, norm_plus_one=True,
           embed_scale=True, swa_pattern=2, hf_layer=_GEMMA_HF, gguf_layer=_GEMMA_GGUF),
    Family("gemma3", ("gemma3_text",), "gemma3", activation="gelu_tanh", sandwich_norms=True, norm_plus_one=True,
           embed_scale=True, qk_norm=True, swa_pattern=6, hf_layer=_GEMMA_HF, gguf_layer=_GEMMA_GGUF),
    Family("phi3", ("phi3",), "phi3", hf_layer=_PHI3_HF, gguf_layer=_PHI3_GGUF),
)
_BY_NAME = {f.name: f for f in FAMILIES}
SUPPORTED = tuple(_BY_NAME)


def family(name: str) -> Family:
    """The family of verispec's architecture name; a ValueError naming the supported ones."""
    if name not in _BY_NAME:
        raise ValueError(f"model architecture {name!r} is not supported; supported: {', '.join(SUPPORTED)} "
                         "(HF model_type: " + ", ".join(t for f in FAMILIES for t in f.hf_types) + ")")
    return _BY_NAME[name]


def of_hf_type(model_type: str) -> str:
    """verispec's architecture name for an HF model_type (the type itself where none matches: the
    config then refuses it by that name)."""
    return next((f.name for f in FAMILIES if model_type in f.hf_types), model_type)


def of_gguf_arch(arch: str) -> str:
    return next((f.name for f in FAMILIES if f.gguf_arch == arch), arch)


def hf_parts(name: str, fam: Family) -> tuple[str, ...] | None:
    """verispec's names for an HF checkpoint tensor (several for a fused one, in row order); None
    for a tensor the model does not use (rotary caches and the like)."""
    return _parts(name.removeprefix("model."), _HF_TOP, "layers.", fam.hf_name)


def gguf_parts(name: str, fam: Family) -> tuple[str, ...] | None:
    """As `hf_parts`, for a GGUF tensor name."""
    return _parts(name, _GGUF_TOP, "blk.", fam.gguf_name)


def _parts(name: str, top: dict, layer_prefix: str, layer_name) -> tuple[str, ...] | None:
    if name in top:
        return (top[name],)
    if name.startswith(layer_prefix):
        _, idx, rest = name.split(".", 2)
        ours = layer_name(rest)
        if ours is not None:
            return tuple(f"layers.{idx}.{p}" for p in ((ours,) if isinstance(ours, str) else ours))
    return None


def is_norm(ours: str) -> bool:
    """A norm's weight (whose HF value is w where the family scales by 1 + w)."""
    return ours == "norm" or ours.endswith("_norm")
