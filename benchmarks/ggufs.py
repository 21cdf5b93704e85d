"""GGUF files re-quantized to another scheme, for tests and benchmarks.

`requantize_file` reads a GGUF file, decodes every tensor to float32 and writes a copy whose
matrices are re-quantized by a scheme (a llama.cpp file type): the same metadata (architecture,
hyper-parameters, tokenizer, chat template, ...) and the same tensors, in the same order, with
the same names and shapes. So one bundled model yields files of every block type verispec loads
(the K-quants through verispec's own encoder, `verispec.models.kquants`; the 32-weight types
through gguf's), without llama.cpp's quantize tool. `quantized_copy` caches such a copy.

Schemes, for the 2-D+ `*.weight` tensors (everything else, norms and biases, is written F32):
- "Q4_K_M": llama.cpp's mix (llama-quant.cpp, llama_tensor_get_type): Q4_K, but Q6_K for
  output.weight (for token_embd.weight instead where the model ties its embeddings, i.e. has no
  output.weight) and for attn_v (attn_qkv, attn_kv_b) and ffn_down in the layers where
  use_more_bits holds (the first and last eighth and every third one between).
- "Q6_K", "Q5_K", "Q4_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0": every matrix that type, like
  `llama-quantize --pure` (no Q6_K output.weight or bigger first layers).
As in llama.cpp, a matrix whose rows (its innermost GGUF dim) are not whole 256-blocks falls back
from Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and one not of whole 32-blocks to F16.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T, GGUFValueType as V, LlamaFileType

from verispec.models.gguf_index import file_key
from verispec.models.kquants import quantize_k

_VERSION = 1  # part of the cache key: bump when a copy's contents would change

FILE_TYPES = {
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S, "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
}
SCHEMES = tuple(FILE_TYPES)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}  # llama.cpp's tensor_type_fallback

logger = logging.getLogger(__name__)


def requantize_file(src: str | Path, dst: str | Path, scheme: str) -> Path:
    """Write `dst`: the GGUF file `src` with its matrices re-quantized by `scheme` (SCHEMES)."""
    if scheme not in FILE_TYPES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    reader = gguf.GGUFReader(src)
    arch = _string_field(reader, gguf.Keys.General.ARCHITECTURE)
    types = plan_types([(t.name, [int(n) for n in t.shape]) for t in reader.tensors], scheme,
                       n_layers=_block_count(reader, arch))
    dst = Path(dst)
    # use_temp_file: tensors spool to a temporary file, not all held in memory until written
    writer = gguf.GGUFWriter(dst, arch, use_temp_file=True)
    try:
        _copy_metadata(reader, writer, FILE_TYPES[scheme])
        for tensor in reader.tensors:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            qtype = types[tensor.name]
            data = encode(values, qtype)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return dst


def quantized_copy(src: str | Path, scheme: str, cache_dir: str | Path) -> Path:
    """`src` re-quantized by `scheme`, written once under `cache_dir` (keyed by the source's
    path, size and mtime and the scheme) and reused while the source is unchanged."""
    src, cache_dir = Path(src), Path(cache_dir)
    if scheme not in FILE_TYPES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    path = cache_dir / f"{src.stem}.{scheme}.{file_key(src, scheme, str(_VERSION))}.gguf"
    return written_once(path, lambda tmp: requantize_file(src, tmp, scheme))


def written_once(path: Path, write: Callable[[Path], object]) -> Path:
    """`path`, made by `write` unless it exists: written under a temporary name, then one rename, so
    a reader never sees half a file and concurrent writers each finish their own before one
    replaces the other."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------------------ tensor types
def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every
    third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def plan_types(tensors: list[tuple[str, list[int]]], scheme: str, n_layers: int | None = None) -> dict[str, T]:
    """The type of each tensor ((name, GGUF shape innermost first)) under `scheme`.

    As llama.cpp: attn_v-like tensors are counted in its order (by blk.N layer, then name; not
    the file's, which may list blk.10 before blk.2), ffn_down's layer is its blk.N of `n_layers`
    (the block count; else the number of ffn_down tensors)."""
    if scheme not in FILE_TYPES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    names = [name for name, _ in tensors]
    tied = "output.weight" not in names
    i_v = {name: i for i, name in enumerate(sorted(filter(_is_attn_v, names), key=_llama_order))}
    n_layers = n_layers or sum("ffn_down" in name for name in names)
    out = {}
    for name, shape in tensors:
        if len(shape) < 2 or not name.endswith("weight"):
            out[name] = T.F32
            continue
        qtype = T.Q4_K if scheme == "Q4_K_M" else T[scheme]
        if scheme == "Q4_K_M":
            if name == "output.weight" or (tied and name in ("token_embd.weight", "per_layer_token_embd.weight")):
                qtype = T.Q6_K
            elif name in i_v:
                qtype = T.Q6_K if use_more_bits(i_v[name], len(i_v)) else qtype
            elif "ffn_down" in name:
                qtype = T.Q6_K if use_more_bits(_llama_order(name)[0], n_layers) else qtype
        out[name] = _fallback(qtype, shape[0])
    return out


def _llama_order(name: str) -> tuple[int, str]:
    """llama.cpp's tensor order: by blk.N layer (-1 for none), then by name."""
    layer = re.match(r"blk\.(\d+)\.", name)
    return (int(layer[1]) if layer else -1, name)


def _is_attn_v(name: str) -> bool:
    return any(part in name for part in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"))


def _fallback(qtype: T, k: int) -> T:
    if qtype in _FALLBACK and k % 256:
        qtype = _FALLBACK[qtype]
    return T.F16 if k % 32 else qtype


def encode(values: np.ndarray, qtype: T) -> np.ndarray:
    """float32 values (numpy order, rows innermost) as `qtype` data for GGUFWriter.add_tensor:
    float32/float16 arrays, or uint8 blocks of shape [..., bytes per row]."""
    values = np.asarray(values, np.float32)
    if qtype == T.F32:
        return values
    if qtype in K_QUANTS:
        rows = quantize_k(values.reshape(-1, values.shape[-1]), qtype.name)
        return rows.reshape(*values.shape[:-1], rows.shape[-1])
    return gguf.quants.quantize(values, qtype)


# --------------------------------------------------------------------------------- metadata
def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, file_type: int) -> None:
    """Every key/value field of the source, in order, but general.file_type set to the scheme's."""
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
            continue  # GGUFWriter writes these itself: the header's counts, the architecture it was given
        if name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(field.parts[field.data[0]][0]))
        elif name == gguf.Keys.General.FILE_TYPE:
            writer.add_uint32(name, int(file_type))
        elif field.types[0] == V.ARRAY and not field.data:
            # GGUFWriter cannot write an empty array
            logger.warning("%s: dropping the empty array %s", reader.data.filename, name)
        else:
            value, sub_type = field_value(field)
            writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    if gguf.Keys.General.FILE_TYPE not in reader.fields:
        writer.add_uint32(gguf.Keys.General.FILE_TYPE, int(file_type))


def field_value(field) -> tuple[object, V | None]:
    """(value, array item type) of a reader field as GGUFWriter.add_key_value takes it. Strings
    stay raw bytes, so a token that is not valid UTF-8 is copied as it is."""
    main = field.types[0]
    if main == V.ARRAY:
        if len(field.types) != 2:
            raise ValueError(f"{field.name}: arrays of arrays are not supported")
        parts = [field.parts[i] for i in field.data]
        if field.types[1] == V.STRING:
            return [bytes(p) for p in parts], V.STRING
        return np.concatenate(parts).tolist(), field.types[1]
    part = field.parts[field.data[0]]
    return (bytes(part) if main == V.STRING else part.tolist()[0]), None


def _string_field(reader: gguf.GGUFReader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"{reader.data.filename}: no {key} field")
    return bytes(field.parts[field.data[0]]).decode()


def _block_count(reader: gguf.GGUFReader, arch: str) -> int | None:
    field = reader.fields.get(f"{arch}.block_count")
    return None if field is None else int(field.parts[field.data[0]][0])
