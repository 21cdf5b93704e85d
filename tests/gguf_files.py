"""GGUF files written from tiny HF checkpoints as llama.cpp's converter writes them, for the model
families verispec loads from both: its tensor names, Gemma's norms stored as 1 + w, Phi-3's fused
q|k|v and gate|up, LongRoPE's factors as tensors, each family's metadata keys. Independent of
verispec's loader on purpose: the tests read these files with both verispec and transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "llama": "llama"}
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}


def _name(hf: str, gemma: bool) -> str | None:
    hf = hf.removeprefix("model.")
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, idx, rest = hf.split(".", 2)
    stem, kind = rest.rsplit(".", 1)
    if stem == "post_attention_layernorm":
        return f"blk.{idx}.{'post_attention_norm' if gemma else 'ffn_norm'}.{kind}"
    return f"blk.{idx}.{_LAYER[stem]}.{kind}" if stem in _LAYER else None


def write_gguf(checkpoint: str | Path, target: str | Path, qtype: str = "F32") -> str:
    """The checkpoint as a GGUF file; 2-D matrices in `qtype` (F32, Q8_0 or IQ4_NL), the rest F32."""
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint)
    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = _ARCH[cfg["model_type"]]
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(str(target), arch)
    _metadata(w, arch, cfg)
    tensors = {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for hf, tensor in tensors.items():
        name = _name(hf, gemma)
        if name is None:
            continue
        values = tensor.float()
        if gemma and name.endswith("norm.weight"):
            values = values + 1  # llama.cpp's converter stores Gemma's norm as 1 + w
        array = values.numpy()
        if qtype == "Q8_0" and array.ndim == 2 and array.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif qtype == "IQ4_NL" and array.ndim == 2 and array.shape[1] % 32 == 0:
            w.add_tensor(name, iq4_nl(array), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(name, array)
    _rope_factors(w, cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(target)


_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def iq4_nl(array: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of a matrix (gguf-py has no IQ4_NL quantizer): per 32 inputs an fp16 d = max|w|
    / 127 and each weight's nearest table value; byte j holds input j's index (low) and j + 16's."""
    n, k = array.shape
    groups = array.reshape(-1, 32)
    d = (np.abs(groups).max(axis=1, keepdims=True) / 127).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)
    idx = np.abs(groups[:, :, None] / safe[:, :, None] - _IQ4_VALUES).argmin(-1).astype(np.uint8)
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8), qs], axis=1).reshape(n, -1)


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        w.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcapping"])
    if arch == "phi3":
        rotated = int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
        w.add_rope_dimension_count(rotated)


def _rope_factors(w: gguf.GGUFWriter, cfg: dict) -> None:
    """LongRoPE as llama.cpp's converter keeps it: two factor tensors and two keys."""
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") != "longrope":
        return
    original = rope["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / original
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def hf_with_file_weights(checkpoint: str | Path, path: str | Path):
    """The checkpoint's HF model (fp32) holding the file's values, dequantized by gguf-py: HF's
    forward on the same file. (transformers' own GGUF reading leaves out Gemma's soft-caps and
    ties, so it is no oracle for these families.)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    gemma = model.config.model_type.startswith("gemma")
    by_name = {_name(n, gemma): p for n, p in model.state_dict(keep_vars=True).items()}
    reader = gguf.GGUFReader(str(path))
    with torch.no_grad():
        for t in reader.tensors:
            if t.name not in by_name:
                continue
            values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            values = values.reshape(by_name[t.name].shape)
            if gemma and t.name.endswith("norm.weight"):
                values = values - 1
            by_name[t.name].copy_(values)
    return model
