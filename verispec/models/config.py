"""ModelConfig: the architecture facts the forward needs, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verispec.models.architectures import family, of_hf_type


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Attention scores are q.k / sqrt(query_scalar) (Gemma's query_pre_attn_scalar; else head_dim).
    query_scalar: float | None = None
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    sliding_window: int | None = None  # keys a sliding layer sees, its own position included
    sliding_layers: list[bool] | None = None  # which layers slide (None: all, when a window is set)
    rope_local_theta: float | None = None  # sliding layers' own RoPE base, unscaled (Gemma 3)
    partial_rotary_factor: float = 1.0  # the share of each head RoPE rotates (Phi-4-mini)
    # The longest sequence the engine runs: LongRoPE takes its long factors past the original context.
    rope_context: int | None = None

    def __post_init__(self) -> None:
        fam = family(self.architecture)  # refuses an unsupported architecture by name
        self.attention_bias = self.attention_bias or fam.attention_bias
        self.qk_norm = self.qk_norm or fam.qk_norm
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (the keys a query sees, itself included); 0 = all of them."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if self.sliding_layers is None or self.sliding_layers[layer] else 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def part_rows(self, part: str) -> int:
        """Rows of one part of a fused matrix (q, k, v; gate, up)."""
        return {"q": self.num_heads * self.head_dim, "k": self.num_kv_heads * self.head_dim,
                "v": self.num_kv_heads * self.head_dim}.get(part, self.intermediate_size)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = of_hf_type(cfg.get("model_type", "llama"))
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        theta, scaling, local_theta = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        window, sliding = _sliding(cfg, arch)
        partial = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            query_scalar=cfg.get("query_pre_attn_scalar"),
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            sliding_window=window,
            sliding_layers=sliding,
            rope_local_theta=local_theta,
            partial_rotary_factor=float(partial or 1.0),
        )


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None, float | None]:
    """(base, scaling, the sliding layers' own base) from either place transformers keeps them:
    rope_theta / rope_scaling (/ rope_local_base_freq), or, since transformers 5, rope_parameters,
    one dict per layer type where the types differ (Gemma 3)."""
    rope = dict(cfg.get("rope_parameters") or {})
    local = None
    if "full_attention" in rope:  # per layer type
        local = rope.get("sliding_attention", {}).get("rope_theta")
        rope = dict(rope["full_attention"])
    local = cfg.get("rope_local_base_freq", local)
    theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
    rope.pop("partial_rotary_factor", None)
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        scaling = {"original_max_position_embeddings": cfg.get("original_max_position_embeddings"), **scaling}
    return theta, scaling, local


def _sliding(cfg: dict[str, Any], arch: str) -> tuple[int | None, list[bool] | None]:
    """(window, which layers slide): config.json's layer_types where it lists them, else the
    family's pattern (Gemma 2: every other layer; Gemma 3: five of six), else every layer
    (Mistral, Phi-3). Qwen2 slides only with use_sliding_window."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None, None
    types = cfg.get("layer_types")
    if types is not None:
        sliding = [t == "sliding_attention" for t in types]
        return (int(window), sliding) if any(sliding) else (None, None)
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or family(arch).swa_pattern
    if pattern:
        return int(window), [(i + 1) % pattern != 0 for i in range(cfg["num_hidden_layers"])]
    return int(window), None
