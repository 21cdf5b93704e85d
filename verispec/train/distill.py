"""Self-distillation data for a drafter: the target's own answers to the training prompts, and at
every position the target's captured layers (the drafter's context) and its next-token
distribution's top entries (what the drafter learns to match).

The answers come from the engine itself (half greedy, half at temperature 0.8); the features
from one eager pass of the same target model over each whole sequence, as the engine computes
them while serving. Both are written in shards, so an interrupted run resumes at the next shard.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.sampling_params import SamplingParams

SHARD_PROMPTS = 64  # prompts per shard: the unit of resumption
CHUNK = 256  # tokens per forward of the feature pass
TEMPERATURES = (0.0, 0.8)  # answers alternate between them


@dataclass(slots=True)
class Sample:
    """One training sequence: prompt + answer ids, where the answer starts, and per position its
    context features [T, layers * hidden] (bf16) and the target's top-k next tokens and
    probabilities [T, k] (int32, fp16)."""

    ids: torch.Tensor
    answer_start: int
    features: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor

    def as_dict(self) -> dict:
        return {"ids": self.ids, "answer_start": self.answer_start, "features": self.features,
                "top_ids": self.top_ids, "top_probs": self.top_probs}


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                        add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def build_shards(llm, prompts: list[str], out: Path, layer_ids: tuple[int, ...], max_tokens: int,
                 top_k: int, progress=None) -> list[Path]:
    """Every shard of `prompts` under `out` (shard_0000.pt, ...), making those not there yet."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    tokenizer = llm.get_tokenizer()
    for n, lo in enumerate(range(0, len(prompts), SHARD_PROMPTS)):
        path = out / f"shard_{n:04d}.pt"
        paths.append(path)
        if not path.exists():
            chunk = [chat_ids(tokenizer, p) for p in prompts[lo : lo + SHARD_PROMPTS]]
            params = [SamplingParams(temperature=TEMPERATURES[i % len(TEMPERATURES)], seed=lo + i,
                                     max_tokens=max_tokens) for i in range(len(chunk))]
            outs = llm.generate(chunk, params, use_tqdm=False)
            samples = [target_features(llm.engine.model, p + list(o.outputs[0].token_ids), len(p), layer_ids, top_k)
                       for p, o in zip(chunk, outs)]
            tmp = path.with_suffix(".tmp")
            torch.save([s.as_dict() for s in samples], tmp)
            tmp.replace(path)  # a shard is there whole or not at all
        if progress is not None:
            progress(n + 1, -(-len(prompts) // SHARD_PROMPTS))
    return paths


@contextlib.contextmanager
def _capturing(model, layer_ids: tuple[int, ...]):
    """The model eager (its compiled graph was built without these outputs), capturing the layers."""
    saved = model.compiled, model.capture_layers
    model.compiled, model.capture_layers = None, tuple(layer_ids)
    try:
        yield
    finally:
        model.compiled, model.capture_layers = saved
        model.captured = None


@torch.inference_mode()
def target_features(model, ids: list[int], answer_start: int, layer_ids: tuple[int, ...], top_k: int,
                    block_size: int = 16) -> Sample:
    """One sequence through the target in chunks, with a cache of its own."""
    n = len(ids)
    blocks = list(range(-(-n // block_size)))
    kv = model.new_kv_cache(len(blocks), block_size)
    dev = model.embed.device
    feats, top_i, top_p = [], [], []
    with _capturing(model, layer_ids):
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            meta = build_attention_metadata([SeqSpan(0, hi - lo, hi, blocks)], block_size, dev, model.dtype)
            hidden = model(torch.tensor(ids[lo:hi], device=dev), torch.arange(lo, hi, device=dev), meta, kv.layers)
            feats.append(model.captured.to(torch.bfloat16).cpu())
            probs = model.compute_logits(hidden).float().softmax(dim=-1)
            p, i = probs.topk(top_k, dim=-1)
            top_i.append(i.to(torch.int32).cpu())
            top_p.append(p.to(torch.float16).cpu())
    return Sample(torch.tensor(ids, dtype=torch.int32), answer_start, torch.cat(feats), torch.cat(top_i),
                  torch.cat(top_p))


def load_samples(paths: list[Path]) -> list[Sample]:
    return [Sample(**d) for p in paths for d in torch.load(p, weights_only=True)]
