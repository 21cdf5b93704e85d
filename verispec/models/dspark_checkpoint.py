"""DSpark and DFlash drafter checkpoints: config.json and safetensors as the published exports write them.

A checkpoint is an HF directory:
- config.json: the draft layers' own config (a Qwen3-style decoder: hidden_size, heads,
  intermediate_size, num_hidden_layers, rms_norm_eps, RoPE) plus the drafter's fields, either in
  `dflash_config` or at the top level: `target_layer_ids` (the target layers whose outputs are the
  context, 0-based, each layer's output), `mask_token_id`, `block_size`, `markov_rank`,
  `markov_head_type`, `draft_vocab_size`, `enable_confidence_head`, `confidence_head_with_markov`,
  `sample_from_anchor`;
- tensors: `fc`, `hidden_norm`, `layers.{i}.*` (input_layernorm, self_attn.{q,k,v,o}_proj,
  q_norm, k_norm, post_attention_layernorm, mlp.{gate,up,down}_proj), `norm`, and optionally
  `lm_head` (a reduced vocabulary's rows, with `d2t`: target id = draft id + d2t[draft id]; left
  out, they are the target's head rows at those ids),
  `markov_w1` / `markov_w2` (the Markov head, bare or under `markov_head.`) and
  `confidence_head.proj`. `embed_tokens` and a full-vocabulary `lm_head` are copies of the
  target's, which the drafter uses itself.

Two block layouts exist. DSpark predicts from every slot of [anchor, mask x (B - 1)], slot j the
token after position anchor + j (`sample_from_anchor`); DFlash predicts from the mask slots, slot
j the token at anchor + j. A checkpoint that does not say is DSpark when it has either head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.models.config import ModelConfig

MARKOV_HEAD_TYPES = ("vanilla",)
# Prefixes exports put before the drafter's own names.
_PREFIXES = ("model.", "draft_model.")
_MARKOV_NAMES = {"markov_w1": "markov_w1.weight", "markov_w1.weight": "markov_w1.weight",
                 "markov_head.markov_w1.weight": "markov_w1.weight", "markov_w2": "markov_w2.weight",
                 "markov_w2.weight": "markov_w2.weight", "markov_head.markov_w2.weight": "markov_w2.weight"}


@dataclass(frozen=True, slots=True)
class DSparkConfig:
    layers: ModelConfig  # the draft's decoder layers
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    sample_from_anchor: bool  # DSpark: every slot predicts; DFlash: the mask slots do
    markov_rank: int  # 0: no Markov head
    confidence_head: bool
    confidence_with_markov: bool  # the confidence head also reads the previous token's Markov row
    draft_vocab_size: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_softcap: float | None = None

    @property
    def first_slot(self) -> int:
        """The block slot whose output is the first draft."""
        return 0 if self.sample_from_anchor else 1

    @property
    def max_drafts(self) -> int:
        return self.block_size - self.first_slot

    @property
    def is_dspark(self) -> bool:
        return self.markov_rank > 0 or self.confidence_head


def read_dspark_checkpoint(path: str | Path) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """The config and the tensors under the names above (exports' prefixes dropped)."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config.model: {str(path)!r} is not a DSpark / DFlash checkpoint "
                         "directory (no config.json)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"speculative_config.model: {str(path)!r} holds no *.safetensors files")
    tensors = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            tensors[_own_name(name)] = t
    raw = json.loads((path / "config.json").read_text())
    return parse_dspark_config(raw, tensors), tensors


def _own_name(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return _MARKOV_NAMES.get(name, name)


def parse_dspark_config(raw: dict, tensors: dict[str, torch.Tensor]) -> DSparkConfig:
    """The drafter's config from config.json; the tensors settle what the config leaves out."""
    inner = raw.get("dflash_config") or {}
    get = lambda key, default=None: inner.get(key, raw.get(key, default))  # noqa: E731
    missing = [k for k in ("target_layer_ids", "mask_token_id") if get(k) is None]
    if missing:
        raise ValueError(f"speculative_config.model: config.json lacks {missing} (in dflash_config or at the top level)")
    layer_cfg = ModelConfig.from_hf_dict({**raw, "model_type": "qwen3"})
    layer_cfg.qk_norm = "layers.0.self_attn.q_norm.weight" in tensors
    kind = get("markov_head_type", "vanilla")
    has_markov = "markov_w1.weight" in tensors
    if has_markov and kind not in MARKOV_HEAD_TYPES:
        raise ValueError(f"markov_head_type {kind!r} is not supported (supported: {', '.join(MARKOV_HEAD_TYPES)})")
    rank = int(tensors["markov_w1.weight"].shape[1]) if has_markov else 0
    confidence = "confidence_head.proj.weight" in tensors
    conf_in = int(tensors["confidence_head.proj.weight"].shape[1]) if confidence else 0
    lm_head = tensors.get("lm_head.weight")
    vocab = int(get("draft_vocab_size") or (lm_head.shape[0] if lm_head is not None else raw.get("vocab_size")))
    block = int(get("block_size", 16))
    anchor = get("sample_from_anchor")
    cfg = DSparkConfig(
        layers=layer_cfg,
        target_layer_ids=tuple(int(i) for i in get("target_layer_ids")),
        mask_token_id=int(get("mask_token_id")),
        block_size=block,
        sample_from_anchor=bool(has_markov or confidence) if anchor is None else bool(anchor),
        markov_rank=rank,
        confidence_head=confidence,
        confidence_with_markov=confidence and conf_in == layer_cfg.hidden_size + rank and rank > 0,
        draft_vocab_size=vocab,
        input_embedding_scale=float(get("input_embedding_scale", 1.0) or 1.0),
        output_multiplier=float(get("output_multiplier", 1.0) or 1.0),
        final_softcap=get("final_logit_softcapping"),
    )
    _check_shapes(cfg, tensors, conf_in)
    return cfg


def _check_shapes(cfg: DSparkConfig, tensors: dict[str, torch.Tensor], conf_in: int) -> None:
    lc = cfg.layers
    if cfg.block_size < 2 or cfg.max_drafts < 1:
        raise ValueError(f"block_size must be at least 2; got {cfg.block_size}")
    needed = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
        f"layers.{i}.{name}.weight" for i in range(lc.num_layers)
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    absent = [n for n in needed if n not in tensors]
    if absent:
        raise ValueError(f"speculative_config.model: the checkpoint lacks tensors {absent[:4]}"
                         + (f" and {len(absent) - 4} more" if len(absent) > 4 else ""))
    fc = tensors["fc.weight"]
    if fc.shape[0] != lc.hidden_size or fc.shape[1] % len(cfg.target_layer_ids):
        raise ValueError(f"fc is {list(fc.shape)}: expected [{lc.hidden_size}, "
                         f"{len(cfg.target_layer_ids)} x the target's hidden size]")
    if cfg.confidence_head and conf_in not in (lc.hidden_size, lc.hidden_size + cfg.markov_rank):
        raise ValueError(f"confidence_head.proj takes {conf_in} inputs: expected {lc.hidden_size} "
                         f"or {lc.hidden_size + cfg.markov_rank}")
    if cfg.markov_rank and tensors.get("markov_w2.weight") is None:
        raise ValueError("the checkpoint has markov_w1 but not markov_w2")
    if cfg.draft_vocab_size != tensors.get("lm_head.weight", torch.empty(cfg.draft_vocab_size)).shape[0]:
        raise ValueError(f"draft_vocab_size is {cfg.draft_vocab_size} but lm_head has "
                         f"{tensors['lm_head.weight'].shape[0]} rows")


def check_against_target(cfg: DSparkConfig, tensors: dict[str, torch.Tensor], target: ModelConfig) -> None:
    """The drafter must have been made for this target: its layers, width and vocabulary."""
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers - 1]
    if bad:
        raise ValueError(f"target_layer_ids {list(cfg.target_layer_ids)} must name layers 0..{target.num_layers - 2} "
                         f"of the target's {target.num_layers} (not its last, whose output HF gives normed)")
    if cfg.layers.hidden_size != target.hidden_size:
        raise ValueError(f"the drafter's hidden_size {cfg.layers.hidden_size} differs from the target's "
                         f"{target.hidden_size}: it reads the target's embeddings")
    width = len(cfg.target_layer_ids) * target.hidden_size
    if tensors["fc.weight"].shape[1] != width:
        raise ValueError(f"fc takes {tensors['fc.weight'].shape[1]} features; the target's "
                         f"{len(cfg.target_layer_ids)} layers give {width}")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the target's vocabulary ({target.vocab_size})")
    reduced = cfg.draft_vocab_size != target.vocab_size
    if reduced and "d2t" not in tensors:
        raise ValueError(f"the drafter's vocabulary has {cfg.draft_vocab_size} tokens, the target's "
                         f"{target.vocab_size}, and the checkpoint has no d2t map")
    if cfg.draft_vocab_size > target.vocab_size:
        raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary ({target.vocab_size})")
    if cfg.markov_rank and tensors["markov_w1.weight"].shape[0] != target.vocab_size:
        raise ValueError(f"markov_w1 has {tensors['markov_w1.weight'].shape[0]} rows: one per target token "
                         f"({target.vocab_size}) expected")
