"""Checkpoint loading: an HF directory (config.json + *.safetensors) or a single .gguf file.

Both forms come out as one `ModelConfig` plus a dict of weights under verispec's own names
(`embed`, `layers.{i}.q`, ..., `norm`, `lm_head`) in [out, in] layout, so the model module never
knows where its weights came from. A weight is a dense fp32/dtype tensor, or, in the quantized
tier, a GGUF file's blocks as the file stores them (`GGUFBlocks`: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K) or a `QuantizedWeight` (round-to-nearest codes of an HF checkpoint's matrices,
or 8-bit codes of a GGUF type verispec does not keep, which `weight_kinds` names).
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from verispec import envs
from verispec.models.architectures import Family, family, gguf_parts, hf_parts, is_norm, of_gguf_arch
from verispec.models.config import ModelConfig
from verispec.models.gguf_blocks import PACKED_KINDS, GGUFBlocks, widened
from verispec.models.gguf_index import read_index
from verispec.models.model_path import ModelNotFoundError, resolve_model_path  # noqa: F401 - loader's names too
from verispec.models.quant import GROUP_SIZE, QuantizedWeight, quantize_rtn

logger = logging.getLogger("verispec")

_DENSE_GGUF = ("F32", "F16", "BF16")
# The matrices of a decoder layer; embeddings and the lm_head are quantized separately.
_LAYER_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")

def load_checkpoint(
    model: str, dtype: torch.dtype, quantization: str | None = None
) -> tuple[ModelConfig, dict[str, "torch.Tensor | QuantizedWeight"]]:
    """Weights in `dtype` (dense), or with the matrices quantized as `quantization` asks:
    "gguf" keeps the file's blocks, "int4" / "int8" round each layer matrix to nearest in groups of
    32. The embedding and lm_head never go below 8 bits: at 4 bits they alone break the fast tier's
    fidelity bar."""
    path = resolve_model_path(model)
    if quantization == "gguf":
        return _load_gguf(path, dtype, keep_blocks=True)
    if quantization is None:
        return _load_gguf(path, dtype) if path.is_file() else _load_hf_dir(path, dtype)
    cfg, weights = _load_gguf(path, torch.float32) if path.is_file() else _load_hf_dir(path, torch.float32)
    for name, w in weights.items():
        if w.dim() == 2 and w.shape[1] % GROUP_SIZE == 0:
            layer_matrix = name.startswith("layers.") and name.rsplit(".", 1)[-1] in _LAYER_MATRICES
            weights[name] = quantize_rtn(w, 4 if quantization == "int4" and layer_matrix else 8)
        else:
            weights[name] = w.to(dtype)
    return cfg, weights


def resolve_precision(
    model: str, dtype: torch.dtype | None, quantization: str | None
) -> tuple[torch.dtype, str | None]:
    """(dtype, quantization) from the user's choice, with dtype=None meaning "auto": a GGUF file
    runs quantized in bfloat16, an HF checkpoint in its own torch_dtype, as vLLM does.
    `quantization` is one of config.QUANTIZATIONS or None (EngineConfig.validate checks it)."""
    path = resolve_model_path(model)
    if quantization == "gguf" and not path.is_file():
        raise ValueError("quantization='gguf' needs a .gguf model file; use 'int4' or 'int8' for an HF checkpoint")
    if dtype is None:
        if quantization is None and path.is_file():
            quantization = "gguf"
        dtype = torch.bfloat16 if quantization else _hf_dtype(path)
    # A GGUF file's codes decode exactly, so float32 on them is still the exact tier (the CPU kernel
    # of `DecodedLinear`, or the dense decoded values elsewhere).
    exact_gguf = quantization == "gguf" and dtype == torch.float32
    if quantization is not None and dtype != torch.bfloat16 and not exact_gguf:
        raise ValueError(
            f"quantization={quantization!r} computes in bfloat16 (the int4 kernels' activations); use "
            "dtype='bfloat16' or 'auto', or dtype='float32' with quantization=None (or 'gguf' on a GGUF "
            "file) for the exact tier"
        )
    return dtype, quantization


def _hf_dtype(path: Path) -> torch.dtype:
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"  # transformers 5 writes "dtype"
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


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
            weights |= {ours: part.to(dtype) for ours, part in hf_tensors(name, tensor, cfg)}
    return cfg, weights


def hf_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """An HF checkpoint tensor under verispec's names: a fused one split into its parts (rows in
    order), a norm stored as w where the family scales by 1 + w given as 1 + w (what GGUF files
    hold), computed in fp32; [] for a tensor the model does not use. A fused tensor whose rows are
    not its parts' is a ValueError naming it."""
    fam = family(cfg.architecture)
    names = hf_parts(name, fam)
    if names is None:
        return []
    if len(names) > 1:
        sizes = [cfg.part_rows(n.rsplit(".", 1)[-1]) for n in names]
        if tensor.dim() != 2 or tensor.shape[0] != sum(sizes):
            raise ValueError(f"weights[{name!r}] has shape {tuple(tensor.shape)}; the model's has {sum(sizes)} rows")
        return list(zip(names, tensor.split(sizes)))
    if fam.norm_plus_one and is_norm(names[0]):
        tensor = tensor.float() + 1.0
    return [(names[0], tensor)]


def internal_name(name: str, cfg: ModelConfig | None = None) -> str | None:
    """verispec's name for an HF checkpoint tensor that maps to one (a fused tensor: its first
    part); None for one the model does not use. cfg: the model's family (default: Llama's names)."""
    names = hf_parts(name, family(cfg.architecture if cfg is not None else "llama"))
    return names[0] if names else None


# -------------------------------------------------------------------------------------- GGUF
def _gguf_field(reader, key: str, default=None):
    return reader.fields.get(key, default)


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
    layers = int(a("block_count"))
    return ModelConfig(
        architecture=of_gguf_arch(arch),
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(a("feed_forward_length")),
        num_layers=layers,
        num_heads=int(heads),
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        max_position_embeddings=int(a("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_longrope_of(reader, a) or scaling,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
        **_gguf_family_facts(of_gguf_arch(arch), a, layers, int(hidden) // int(heads)),
    )


def _gguf_family_facts(arch: str, a, layers: int, hidden_per_head: int) -> dict:
    """What Gemma and Phi-3 files say beyond Llama's keys, as llama.cpp reads them: soft-caps,
    the sliding window and which layers slide (the family's pattern unless the file lists it),
    Gemma 3's local RoPE base, Phi's rotated dims, Gemma's query scale (hidden / heads on the 27B
    models, else the head size, as llama.cpp decides: the files do not carry it)."""
    facts: dict = {"attn_softcap": a("attn_logit_softcapping"), "final_softcap": a("final_logit_softcapping")}
    window = a("attention.sliding_window")
    if window:
        pattern = a("attention.sliding_window_pattern", family(arch).swa_pattern)
        sliding = ([bool(x) for x in pattern] if isinstance(pattern, list)
                   else [(i + 1) % pattern != 0 for i in range(layers)] if pattern else None)
        facts |= {"sliding_window": int(window), "sliding_layers": sliding}
    if arch == "gemma3":
        facts["rope_local_theta"] = float(a("rope.freq_base_swa", 10000.0))
    if arch in ("gemma2", "gemma3") and layers == {"gemma2": 46, "gemma3": 62}[arch]:
        facts["query_scalar"] = float(hidden_per_head)
    rotated, head = a("rope.dimension_count"), a("attention.key_length", hidden_per_head)
    if rotated and rotated != head:
        facts["partial_rotary_factor"] = rotated / head
    return facts


def _longrope_of(reader, a) -> dict | None:
    """Phi-3's LongRoPE, which a GGUF file keeps as two tensors of per-frequency factors."""
    tensors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if "rope_factors_long.weight" not in tensors:
        return None
    factors = {f"{kind}_factor": [float(x) for x in tensors[f"rope_factors_{kind}.weight"].data]
               for kind in ("long", "short")}
    return {"rope_type": "longrope", **factors, "attention_factor": a("rope.scaling.attn_factor"),
            "original_max_position_embeddings": int(a("rope.scaling.original_context_length"))}


def _unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's half split).

    The converter grouped each head's rows as (half, pair) and swapped them to (pair, half);
    this is the inverse reshape, as transformers' GGUF conversion does it, as a row index."""
    half = rows // n_head // 2
    return torch.arange(rows).view(n_head, half, 2).transpose(1, 2).reshape(rows)


def _load_gguf(path: Path, dtype: torch.dtype, keep_blocks: bool = False):
    """keep_blocks: matrices of the packed kernel's types stay the file's blocks (read from the
    file when their layer is built); IQ4_NL and IQ4_XS become their exact values in 8-bit codes;
    other quantized types (Q2_K, Q3_K, the other IQ types) are re-quantized to 8 bits, which loses
    next to nothing; `weight_kinds` says which."""
    cfg, tensors = read_index(path, _gguf_config, cache_dir())
    data = np.memmap(path, dtype=np.uint8, mode="r")
    fam = family(cfg.architecture)
    weights: dict[str, torch.Tensor | QuantizedWeight | GGUFBlocks] = {}
    decoding = {} if keep_blocks else _decoding([t for t in tensors if gguf_parts(t.name, fam) is not None], data)
    for t in tensors:
        names = gguf_parts(t.name, fam)
        if names is None:
            continue
        shape, kind, raw = tuple(t.shape), t.kind, data[t.offset : t.offset + t.n_bytes]
        exact = widened(raw, kind, shape) if keep_blocks and len(shape) == 2 else None
        if keep_blocks and kind in PACKED_KINDS and len(shape) == 2:
            w = GGUFBlocks.from_file(path, t.offset, kind, shape)
        elif exact is not None:
            w = exact
        else:
            w = decoding[t.name].result() if t.name in decoding else _decoded(raw, kind, shape)
            if keep_blocks and kind not in _DENSE_GGUF and w.dim() == 2 and shape[1] % GROUP_SIZE == 0:
                w = quantize_rtn(w, 8, source=kind)
        for ours, part in _gguf_split(names, w, cfg, fam):
            weights[ours] = part.to(dtype) if isinstance(part, torch.Tensor) else part
    return cfg, weights


def _decoding(tensors: list, data: np.ndarray) -> dict[str, Future]:
    """Each tensor's fp32 values, decoding on every core: the exact tier decodes every matrix (gguf's
    numpy, 10 s for a 1B file on one core), and numpy releases the GIL inside each operation."""
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # leaving it waits: all decoded by then
        return {t.name: pool.submit(_decoded, data[t.offset : t.offset + t.n_bytes], t.kind, tuple(t.shape))
                for t in tensors}


def _decoded(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's fp32 values, a copy of its own (never a view of the file's map)."""
    values = _values(raw, kind).reshape(shape)
    fresh = kind not in _DENSE_GGUF and values.dtype == np.float32 and values.flags.c_contiguous
    return torch.from_numpy(values if fresh else np.array(values, dtype=np.float32, order="C"))


def _values(raw: np.ndarray, kind: str) -> np.ndarray:
    """A tensor's values from its bytes: the dense types as views (gguf's package costs 0.25 s to
    import, and a file's norms are all a warm start reads this way), the rest through gguf."""
    if kind == "F32":
        return raw.view(np.float32)
    if kind == "F16":
        return raw.view(np.float16)
    if kind == "BF16":  # the upper half of an fp32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[kind])


def _gguf_split(names: tuple[str, ...], w, cfg: ModelConfig, fam: Family) -> list:
    """A file's tensor as its parts (a fused qkv or gate|up split by rows), q and k rows back in
    HF's rotary order where llama.cpp permuted them (Llama-style families only)."""
    start, parts = 0, []
    for ours in names:
        rows = cfg.part_rows(ours.rsplit(".", 1)[-1]) if len(names) > 1 else w.shape[0]
        index = torch.arange(start, start + rows)
        if fam.permuted_qk and (ours.endswith(".q") or ours.endswith(".k")):
            index = index[_unpermute_rows(rows, cfg.num_heads if ours.endswith(".q") else cfg.num_kv_heads)]
        if len(names) > 1 or not torch.equal(index, torch.arange(w.shape[0])):
            part = w[index] if isinstance(w, torch.Tensor) else w.map_rows(lambda x, index=index: x[index])
        else:
            part = w
        parts.append((ours, part))
        start += rows
    return parts


def weight_kinds(weights: dict) -> str:
    """The quantized formats of a loaded model, for its start-up line: the file's types it keeps,
    those widened to exact 8-bit codes, and those re-quantized to 8 bits ("Q4_K, Q6_K; IQ4_XS as
    exact 8-bit codes; Q3_K re-quantized to 8 bits"); "" if none."""
    kept = sorted({w.kind for w in weights.values() if isinstance(w, (GGUFBlocks, QuantizedWeight)) and w.kind})
    others = [w for w in weights.values() if isinstance(w, QuantizedWeight) and w.source]
    text = ", ".join(kept)
    for exact, how in ((True, "as exact 8-bit codes"), (False, "re-quantized to 8 bits")):
        kinds = sorted({w.source for w in others if w.exact_source == exact})
        if kinds:
            text += ("; " if text else "") + ", ".join(kinds) + " " + how
    return text


def cache_dir() -> Path:
    """verispec's on-disk cache (verispec/envs.py: `~/.cache/verispec` unless the environment moves it)."""
    return Path(envs.cache_root())
