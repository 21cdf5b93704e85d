"""In-place weight updates: new values under the checkpoint's own (HF) names, written into the
tensors the model already has, as the loader and the model's constructors would have made them
from a checkpoint holding those values.

- Dense tiers: each value cast to the model's dtype (the loader's `.to(dtype)`).
- Quantized tiers: each matrix re-quantized the way it was loaded (`gguf_blocks.requantize`): a
  GGUF file's Q4_0 / Q4_1 / Q8_0 blocks with gguf's quantizer, its other types (Q5_0, Q5_1, the
  K-quants) as blocks of that type, an HF checkpoint's int4 / int8 with round-to-nearest; then
  packed for its kernel by the same constructor.
- A decoder layer with any new tensor is built again whole (`DecoderLayer`), from the new parts
  and its current ones, so fused matrices (q|k|v, gate|up) come out as a fresh load makes them; a
  tied head is rebuilt with the embedding. Then every tensor is copied into the existing one: no
  tensor object changes, so a compiled graph, which reads the modules' tensors, needs no recompile.

All or nothing: names, shapes and dtypes are checked, and every new module built and compared with
the old one (a re-quantized matrix must keep its kernel format), before the first tensor is written.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from verispec.models.config import ModelConfig
from verispec.models.llama import DecoderLayer, LlamaModel
from verispec.models.architectures import family
from verispec.models.loader import hf_tensors
from verispec.models.gguf_blocks import GGUFBlocks, dequantize, is_quantized, requantize
from verispec.models.quant import QuantizedWeight

_LAYER_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole model (not a tensor-parallel shard) by verispec's name."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        layer = {"attn_norm": (h,), "mlp_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q),
                 "gate": (inter, h), "up": (inter, h), "down": (h, inter)}
        if cfg.attention_bias:
            layer |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
        if cfg.qk_norm:
            layer |= {"q_norm": (d,), "k_norm": (d,)}
        if family(cfg.architecture).sandwich_norms:
            layer |= {"post_attn_norm": (h,), "post_mlp_norm": (h,)}
        shapes |= {f"layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def read_safetensors(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a safetensors file, or of every *.safetensors file in a directory."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"weights: {str(path)!r} is not a safetensors file or a directory holding some")
    return [item for f in files for item in load_file(str(f)).items()]


def check_update(named: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The update under verispec's names; a ValueError naming the first tensor that is not one of
    the model's (name), does not fit (shape), is not floating point (dtype) or not finite."""
    shapes = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    tied_head = None
    for hf, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weights[{hf!r}] is a {type(tensor).__name__}, not a tensor")
        parts = hf_tensors(hf, tensor.detach(), cfg)  # a fused tensor's parts; Gemma's norms as 1 + w
        if [ours for ours, _ in parts] == ["lm_head"] and cfg.tie_word_embeddings:
            tied_head = (hf, tensor)  # a tied model's state dict lists the embedding twice
            continue
        if not parts or any(ours not in shapes for ours, _ in parts):
            raise ValueError(f"weights[{hf!r}]: the model has no tensor of that name")
        for ours, part in parts:
            if ours in out:
                raise ValueError(f"weights[{hf!r}] is given twice")
            if tuple(part.shape) != shapes[ours]:
                raise ValueError(f"weights[{hf!r}] has shape {tuple(tensor.shape)}; the model's is {shapes[ours]}")
        if not tensor.is_floating_point():
            raise ValueError(f"weights[{hf!r}] has dtype {tensor.dtype}; expected a floating-point tensor")
        # One pass, no allocation: the sum is NaN or infinite if a value is (or if they are absurdly large).
        if not torch.isfinite(tensor.sum(dtype=torch.float32)):
            raise ValueError(f"weights[{hf!r}] holds NaN or infinite values")
        out |= dict(parts)
    if tied_head is not None and not ("embed" in out and torch.equal(tied_head[1].detach(), out["embed"])):
        raise ValueError(f"weights[{tied_head[0]!r}]: the model ties its head to the embedding; "
                         "update the embedding (embed_tokens) instead")
    return out


def prepare(update: dict[str, torch.Tensor], model: LlamaModel) -> dict[str, "torch.Tensor | QuantizedWeight | GGUFBlocks"]:
    """What the loader would have handed over for these values: re-quantized where the model's
    tensor was loaded quantized, else cast. `model` may be a tensor-parallel shard: a quantized
    matrix's format is the same in every shard, and the full matrix is quantized before sharding."""
    out: dict[str, torch.Tensor | QuantizedWeight | GGUFBlocks] = {}
    for name, values in update.items():
        like = model.sources.get(name)
        out[name] = requantize(values.float(), like) if like is not None else values.to(model.dtype)
    return out


class PendingUpdate:
    """An update built and checked against the model, not yet written (`commit` writes it): under
    tensor parallelism every rank builds its part before any rank writes."""

    def __init__(self, model: LlamaModel, new: dict, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]):
        self.model, self.new, self.pairs = model, new, pairs

    @torch.inference_mode()
    def commit(self) -> None:
        for _, old, fresh in self.pairs:
            old.copy_(fresh)
        self.model.sources |= {n: w for n, w in self.new.items() if is_quantized(w)}


@torch.inference_mode()
def build_update(model: LlamaModel, new: dict[str, "torch.Tensor | QuantizedWeight | GGUFBlocks"]) -> PendingUpdate:
    """`new` (this model's or shard's tensors, from `prepare`) built into modules as a fresh load
    would, and checked against the model's tensors; a ValueError if any would change format."""
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for i in sorted({int(n.split(".")[1]) for n in new if n.startswith("layers.")}):
        if i >= len(model.layers):
            continue  # a drafting copy with fewer layers
        mine = {n: w for n, w in new.items() if n.startswith(f"layers.{i}.")}
        old = model.layers[i]
        dense = _dense_layer_pairs(old, f"layers.{i}.", mine)  # slices written in place: no allocation
        if dense is not None:
            pairs += dense
        else:
            fresh = DecoderLayer(model.cfg, _layer_parts(model, i) | mine, i, model.dtype, model.embed.device,
                                 model.parallel)
            pairs += _tensor_pairs(f"layers.{i}", old, fresh)
    if "norm" in new:
        pairs.append(("norm", model.norm.weight, new["norm"]))
    if "embed" in new and model.embed.numel():  # an empty table: lookups read the tied head's rows
        embed = new["embed"]
        table = dequantize(embed) if is_quantized(embed) else embed
        pairs.append(("embed", model.embed, table.to(device=model.embed.device, dtype=model.dtype)))
    if "embed" in new or "lm_head" in new:
        embed = new.get("embed", model.sources.get("embed", model.embed))
        lm_head = new.get("lm_head", model.sources.get("lm_head", _dense_head(model)))
        head = lm_head if lm_head is not None and not model.cfg.tie_word_embeddings else embed
        if model.lm_head.holds_dense and not is_quantized(head):
            pairs.append(("lm_head", *model.lm_head.part(0, head.shape[0], head.to(model.dtype))))
        else:
            pairs += _tensor_pairs("lm_head", model.lm_head, model.make_head(embed, lm_head))
    for name, old, fresh in pairs:
        if old.shape != fresh.shape or old.dtype != fresh.dtype:
            raise ValueError(f"updating {name}: the new tensor is {tuple(fresh.shape)} {fresh.dtype}, "
                             f"the model's {tuple(old.shape)} {old.dtype} (the matrix changed format)")
    return PendingUpdate(model, new, pairs)


def _dense_head(model: LlamaModel) -> torch.Tensor | None:
    """An untied dense head's current matrix (None when tied: make_head then uses the embedding)."""
    if model.cfg.tie_word_embeddings or not model.lm_head.holds_dense:
        return None
    return model.lm_head.matrix()


def _units(layer: DecoderLayer) -> list[tuple[nn.Module, tuple[str, ...], tuple[int, ...]]]:
    """The layer's matrices: (module, the checkpoint's parts in row order, their row counts)."""
    kv = layer.kv_size
    return [(layer.qkv, ("q", "k", "v"), (layer.q_size, kv, kv)), (layer.o, ("o",), (layer.o_rows,)),
            (layer.gate_up, ("gate", "up"), (layer.inter, layer.inter)), (layer.down, ("down",), (layer.down_rows,))]


def _dense_layer_pairs(layer: DecoderLayer, p: str, new: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]] | None:
    """(name, slice of the layer's tensor, new values) for a layer of dense matrices (`part`: a
    column slice of a transposed weight, or whole blocks of a blocked one), a bias a slice of the
    fused bias; None where a matrix is quantized or a part is not a slice (the layer is rebuilt)."""
    if not all(m.holds_dense for m, _, _ in _units(layer)):
        return None
    pairs = [(p + n, getattr(layer, n).weight, new[p + n]) for n in _LAYER_NORMS if p + n in new]
    for module, names, sizes in _units(layer):
        start = 0
        for name, size in zip(names, sizes):
            if p + name in new:
                part = module.part(start, size, new[p + name])
                if part is None:
                    return None
                pairs.append((p + name, *part))
            if p + name + "_bias" in new:
                pairs.append((p + name + "_bias", module.bias[start:start + size], new[p + name + "_bias"]))
            start += size
    return pairs


def _layer_parts(model: LlamaModel, i: int) -> dict[str, "torch.Tensor | QuantizedWeight | GGUFBlocks"]:
    """Layer i's tensors as the loader handed them over: the quantized ones as kept, the dense ones
    read back from the modules (a fused matrix split into its parts)."""
    layer, p = model.layers[i], f"layers.{i}."
    parts = {p + n: getattr(layer, n).weight for n in _LAYER_NORMS if getattr(layer, n) is not None}
    for module, names, sizes in _units(layer):
        if all(p + n in model.sources for n in names):
            parts |= {p + n: model.sources[p + n] for n in names}
        else:
            parts |= dict(zip([p + n for n in names], module.matrix().split(sizes)))
        if module is layer.qkv and module.bias is not None:
            parts |= dict(zip([p + "q_bias", p + "k_bias", p + "v_bias"], module.bias.split(sizes)))
    return parts


def _tensor_pairs(prefix: str, old: nn.Module, fresh: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, the model's tensor, the freshly built one) for every parameter and buffer."""
    def tensors(m: nn.Module) -> dict[str, torch.Tensor]:
        return dict(m.named_parameters()) | dict(m.named_buffers())

    a, b = tensors(old), tensors(fresh)
    if a.keys() != b.keys():
        raise ValueError(f"updating {prefix}: the new values change the matrix's format "
                         f"({sorted(a.keys() ^ b.keys())})")
    return [(f"{prefix}.{k}", a[k], b[k]) for k in a]
