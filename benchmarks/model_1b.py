"""A 1B-class benchmark model, made at run time: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32
heads, 8 KV heads, FFN 8192, tied embeddings, rope theta 500000) with SmolLM2's tokenizer (copied
from the bundled file) and seeded random weights, written as an F16 GGUF file and quantized to the
types people download (Q4_K_M, Q4_0, Q8_0): with llama.cpp's own `llama-quantize` where it is
built (verispec/envs.py's llama.cpp variable, docs/benchmarks.md), else with benchmarks/ggufs.py. Cached under
verispec's cache, keyed by the shape, the seed and the quantizer.

Random weights measure speed, memory and load time, never fidelity: fidelity is measured on
SmolLM2 itself re-quantized (tests/test_kquant_models.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

from benchmarks.ggufs import field_value, requantize_file, written_once
from verispec import envs
from verispec.models.loader import cache_dir


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    rope_theta: float = 500000.0
    context: int = 8192
    seed: int = 0


SCHEMES = ("Q4_K_M", "Q4_0", "Q8_0")
_VERSION = 1


def llama_cpp_tool(name: str) -> Path | None:
    """llama.cpp's `name` (llama-bench, llama-server, llama-quantize) from the directory
    the llama.cpp variable names (its build's bin/; verispec/envs.py), or None where it is not built."""
    root = envs.llama_cpp_bin()
    if not root:
        return None
    tool = Path(root).expanduser() / name
    return tool if tool.is_file() and os.access(tool, os.X_OK) else None


def _key(shape: Shape, quantizer: str) -> str:
    text = json.dumps({"shape": asdict(shape), "quantizer": quantizer, "v": _VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_1b(scheme: str, tokenizer_file: str, shape: Shape = Shape(), log=print) -> Path:
    """The model in `scheme` (SCHEMES), made once and cached."""
    quantize = llama_cpp_tool("llama-quantize")
    root = cache_dir() / "bench-models"
    f16 = root / f"llama1b-{_key(shape, 'f16')}.F16.gguf"
    if not f16.exists():
        log(f"writing the 1B benchmark model (random weights, seed {shape.seed}) to {f16}")
    written_once(f16, lambda tmp: _write_f16(tmp, shape, tokenizer_file))
    out = root / f"llama1b-{_key(shape, 'llama-quantize' if quantize else 'ggufs')}.{scheme}.gguf"
    if not out.exists():
        log(f"quantizing it to {scheme} with {quantize or 'benchmarks/ggufs.py'}")

    def write(tmp: Path) -> None:
        if quantize:
            subprocess.run([str(quantize), str(f16), str(tmp), scheme], check=True, capture_output=True)
        else:
            requantize_file(f16, tmp, scheme)

    return written_once(out, write)


def _write_f16(path: Path, shape: Shape, tokenizer_file: str) -> None:
    reader = gguf.GGUFReader(tokenizer_file)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(path, "llama", use_temp_file=True)
    try:
        writer.add_name("verispec-bench-llama-1b")
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.ffn)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_rope_dimension_count(shape.hidden // shape.heads)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_vocab_size(vocab)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        for name, field in reader.fields.items():
            if name.startswith("tokenizer."):
                value, sub_type = field_value(field)
                writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
        _add_tensors(writer, shape, vocab)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _add_tensors(writer: gguf.GGUFWriter, shape: Shape, vocab: int) -> None:
    """Gaussian matrices with llama's initialiser scale (0.02) in fp16, unit norms."""
    rng = np.random.default_rng(shape.seed)
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(vocab, shape.hidden))
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    for i in range(shape.layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(shape.hidden, np.float32))
        writer.add_tensor(p + "attn_q.weight", matrix(shape.hidden, shape.hidden))
        writer.add_tensor(p + "attn_k.weight", matrix(kv, shape.hidden))
        writer.add_tensor(p + "attn_v.weight", matrix(kv, shape.hidden))
        writer.add_tensor(p + "attn_output.weight", matrix(shape.hidden, shape.hidden))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(shape.hidden, np.float32))
        writer.add_tensor(p + "ffn_gate.weight", matrix(shape.ffn, shape.hidden))
        writer.add_tensor(p + "ffn_up.weight", matrix(shape.ffn, shape.hidden))
        writer.add_tensor(p + "ffn_down.weight", matrix(shape.hidden, shape.ffn))
