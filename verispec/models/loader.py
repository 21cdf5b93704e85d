"""Checkpoint loading: an HF directory (config.json + *.safetensors) or a single .gguf file.

Both forms come out as one `ModelConfig` plus a dict of tensors under verispec's own names
(`embed`, `layers.{i}.q`, ..., `norm`, `lm_head`) in [out, in] layout, so the model module never
knows where its weights came from.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from verispec.models.config import ModelConfig

# HF per-layer names -> ours.
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
_GGUF_TOP = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}


class ModelNotFoundError(ValueError):
    pass


def resolve_model_path(model: str) -> Path:
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} not found: pass an HF checkpoint directory (config.json + "
            "*.safetensors) or a .gguf file; verispec never downloads weights"
        )
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(f"model directory {str(path)!r} has no config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFoundError(f"model file {str(path)!r} is not a .gguf file")
    return path


def load_checkpoint(model: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    path = resolve_model_path(model)
    if path.is_file():
        return _load_gguf(path, dtype)
    return _load_hf_dir(path, dtype)


# ---------------------------------------------------------------------------------------- HF
def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model directory {str(path)!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            ours = _hf_name(name)
            if ours is not None:
                weights[ours] = tensor.to(dtype)
    return cfg, weights


def _hf_name(name: str) -> str | None:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed"
    if name == "norm.weight":
        return "norm"
    if name == "lm_head.weight":
        return "lm_head"
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        if rest in _HF_LAYER:
            return f"layers.{idx}.{_HF_LAYER[rest]}"
    return None  # rotary caches and the like


# -------------------------------------------------------------------------------------- GGUF
def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _gguf_config(reader) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    a = lambda k, d=None: _gguf_field(reader, f"{arch}.{k}", d)  # noqa: E731
    hidden = a("embedding_length")
    heads = a("attention.head_count")
    vocab = a("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens"))
    scaling = None
    if a("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": a("rope.scaling.type"), "factor": a("rope.scaling.factor", 1.0)}
    names = {t.name for t in reader.tensors}
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(a("feed_forward_length")),
        num_layers=int(a("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        max_position_embeddings=int(a("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=scaling,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's half split).

    The converter grouped each head's rows as (half, pair) and swapped them to (pair, half);
    this is the inverse reshape, as transformers' GGUF conversion does it.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    cfg = _gguf_config(reader)
    # llama.cpp permutes q/k only for the llama-style rotary layout; Qwen GGUFs keep HF's order.
    permuted = cfg.architecture in ("llama", "mistral")
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        ours = _gguf_name(t.name)
        if ours is None:
            continue
        array = dequantize(t.data, t.tensor_type)
        # GGUF lists dims innermost-first; numpy data is already [out, in] after dequantize.
        array = array.reshape([int(d) for d in reversed(t.shape)])
        if permuted and ours.endswith(".q"):
            array = _unpermute_rope(array, cfg.num_heads)
        elif permuted and ours.endswith(".k"):
            array = _unpermute_rope(array, cfg.num_kv_heads)
        weights[ours] = torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(dtype)
    return cfg, weights


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _GGUF_LAYER:
            return f"layers.{idx}.{_GGUF_LAYER[rest]}"
    return None


# --------------------------------------------------------------------------------- tokenizer
def _cache_dir() -> Path:
    root = os.environ.get("VERISPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "verispec"
    )
    return Path(root)


def load_tokenizer(model: str):
    """The checkpoint's tokenizer and chat template, through transformers; None if it has none.

    Converting a GGUF vocabulary takes several seconds, so the converted tokenizer is saved once
    under ~/.cache/verispec (keyed by the file's path, size and mtime) and reloaded from there.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    if path.is_dir():
        has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
        return AutoTokenizer.from_pretrained(str(path)) if has_tok else None
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged cache entry is rebuilt below
            pass
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else None
    except OSError:  # a read-only home is not an error, only slower next time
        pass
    return tok
