"""The systems the benchmark times: verispec itself and the optional peers (HF, llama.cpp).

Each system takes the same prompts and returns what it generated, greedy, with end-of-sequence
forbidden so that every system produces exactly `max_tokens` tokens per prompt. Forbidding EOS
(rather than generating through it) is the one behaviour all three can express: HF's
`min_new_tokens` masks EOS, llama.cpp always stops at an end-of-generation token, so verispec
uses `min_tokens` (same masking) instead of bare `ignore_eos`, which would let it emit EOS and keep
going and make its ids diverge from HF's after the first EOS.

Every system has a "plain" variant and a "spec" one: speculative decoding with prompt lookup,
each system's own implementation, all drafting the same number of tokens (`SPEC_K`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.llamacpp import LlamaCppSystem
from benchmarks.prompts import Prompt
from benchmarks.system import PEERS, PLAIN, SPEC, SPEC_K, Generation, PeerUnavailable, System, acceptance_from_lengths
from benchmarks.tiers import EXACT, TIERS, Tier, resolved_precision
from verispec.models.loader import cache_dir

# ------------------------------------------------------------------------------- verispec
class VerispecSystem:
    """One precision tier of verispec (benchmarks.tiers): the exact one is the bench's reference."""

    compare = "ids"

    def __init__(self, tier: Tier = EXACT) -> None:
        from verispec import LLM

        self.tier = tier
        self.key, self.label = tier.key, tier.label
        # The bundled default model, on torch's thread count (set by the runner); dtype explicit
        # so that LLM()'s default never decides which tier a row measures.
        self.llm = LLM(dtype=tier.dtype)
        self.spec_llm: Any = None

    def variant_label(self, variant: str) -> str:
        if variant == PLAIN:
            return self.label
        return f"{self.label} + ngram k={SPEC_K}" + (" adaptive" if self.tier.adaptive else "")

    def _engine(self, variant: str) -> Any:
        if variant == PLAIN:
            return self.llm
        if self.spec_llm is None:
            from verispec import LLM

            # The best drafter of the sweep; batch 1 needs a small KV pool, not the default one.
            spec = {"method": "ngram", "num_speculative_tokens": SPEC_K,
                    "adaptive_verification": self.tier.adaptive}
            self.spec_llm = LLM(dtype=self.tier.dtype, num_kv_blocks=256, speculative_config=spec)
        return self.spec_llm

    def generate(self, prompts: list[Prompt], max_tokens: int, variant: str = PLAIN,
                 logprobs: int | None = None) -> Generation:
        from verispec import SamplingParams

        llm = self._engine(variant)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=logprobs)
        before = llm.stats()
        # Every system computes each prompt in full (llama.cpp's cache is reset too); the prefix
        # cache is measured on its own (benchmarks/prefix.py).
        llm.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": p.ids} for p in prompts], params, use_tqdm=False)
        after = llm.stats()
        seqs = [o.outputs[0] for o in outs]
        ids = [list(s.token_ids) for s in seqs]
        gen = Generation([s.text for s in seqs], ids, [len(i) for i in ids])
        if variant == SPEC:
            gen.spec_steps = after["num_drafts"] - before["num_drafts"]
            gen.spec_tokens = gen.spec_steps + after["num_accepted_tokens"] - before["num_accepted_tokens"]
        if logprobs is not None:
            gen.logprobs = [[lp[t].logprob for t, lp in zip(s.token_ids, s.logprobs or [])] for s in seqs]
        return gen

    def precision(self) -> dict[str, str | None]:
        return resolved_precision(self.llm)

    def engines(self) -> dict[str, Any]:
        """Its engines by the speculative sweep's drafter names, for the sweep to reuse."""
        return {"none": self.llm, f"ngram k={SPEC_K}": self._engine(SPEC)}

    def close(self) -> None:
        self.llm = self.spec_llm = None


# ------------------------------------------------------------------------------------- HF
def load_hf_model(model_path: str) -> Any:
    """HF's own GGUF conversion of the model, saved once as safetensors and reloaded from there.

    transformers' GGUF reader spends ~20 s parsing metadata on this file (the weights take 1 s);
    caching its output keeps `--quick` quick without changing what HF computes: the cached
    weights are exactly the ones its converter produced. Keyed by the file's path, size and mtime.
    """
    import torch
    from transformers import AutoModelForCausalLM

    stat = os.stat(model_path)
    key = hashlib.sha256(f"{os.path.realpath(model_path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir() / "bench-hf" / key[:16]  # beside verispec's own cached tokenizers
    if (cached / "config.json").exists():
        try:
            return AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32).eval()
        except Exception:  # noqa: BLE001, S110 - a damaged cache entry is rebuilt below
            pass
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32).eval()
    try:
        _save_plain(model, cached)
    except OSError:  # a read-only home only makes the next run slower
        pass
    return model


def _save_plain(model: Any, cached: Path) -> None:
    """Save a GGUF-loaded HF model as an ordinary fp32 checkpoint.

    save_pretrained refuses (the model is flagged as GGUF-quantized although its weights are
    already dequantized), so the config goes out without its quantization entry and the weights
    through safetensors' save_model, which handles the tied embedding/lm_head pair.
    """
    import json

    from safetensors.torch import save_model

    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # config.json last: its presence marks a complete entry.
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if cached.exists():  # another run got there first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, cached)


@contextmanager
def _count_lookup_calls(calls: list[tuple[int, int]]) -> Iterator[None]:
    """Log HF's prompt-lookup drafter calls (sequence length, draft length) for the acceptance length.

    HF builds its candidate generator inside `generate`, out of reach, so the class method is
    wrapped for the duration of one call. If transformers moves it, acceptance reads "-".
    """
    try:
        from transformers.generation.candidate_generator import (
            PromptLookupCandidateGenerator as Gen,
        )
    except ImportError:
        yield
        return
    original = Gen.get_candidates

    def counting(self: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, input_ids, *args, **kwargs)
        calls.append((int(input_ids.shape[1]), int(out[0].shape[1] - input_ids.shape[1])))
        return out

    Gen.get_candidates = counting
    try:
        yield
    finally:
        Gen.get_candidates = original


class HFSystem:
    key, label, compare = "hf", "HF transformers", "ids"

    def __init__(self, model_path: str, tokenizer: Any) -> None:
        try:
            import torch
            from transformers.utils import logging as hf_logging
        except ImportError as exc:
            raise PeerUnavailable(f"transformers is not installed ({exc}); `{PEERS['hf'].install}`") from exc
        # Its GGUF conversion bar and generation-flag warnings would drown the benchmark's own output.
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch = torch
        self.tokenizer = tokenizer
        self.model = load_hf_model(model_path)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def variant_label(self, variant: str) -> str:
        return self.label if variant == PLAIN else f"{self.label} + prompt lookup"

    def generate(self, prompts: list[Prompt], max_tokens: int, variant: str = PLAIN,
                 logprobs: int | None = None) -> Generation:
        torch = self.torch
        # One left-padded batch: decoder-only models must have every row end at the same column.
        width = max(len(p.ids) for p in prompts)
        rows = [[self.pad] * (width - len(p.ids)) + p.ids for p in prompts]
        mask = [[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts]
        extra: dict[str, Any] = {}
        if variant == SPEC:
            if len(prompts) != 1:
                raise ValueError("HF assisted generation runs one sequence at a time")
            extra["prompt_lookup_num_tokens"] = SPEC_K
        calls: list[tuple[int, int]] = []
        device = self.model.device  # the CPU here; benchmarks/gpu.py moves the model to a GPU
        with torch.inference_mode(), _count_lookup_calls(calls):
            out = self.model.generate(
                input_ids=torch.tensor(rows, device=device),
                attention_mask=torch.tensor(mask, device=device),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=self.pad,
                **extra,
            )
        ids = [row.tolist() for row in out[:, width:]]
        texts = [self.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
        gen = Generation(texts, ids, [len(i) for i in ids])
        if variant == SPEC and calls:
            gen.spec_steps, gen.spec_tokens = acceptance_from_lengths(calls, int(out.shape[1]))
        return gen

    def token_logprobs(self, prompt_ids: list[int], gen_ids: list[int]) -> list[float]:
        """HF's log_softmax at each generated token, from one forward over prompt + generated tokens."""
        torch = self.torch
        seq = torch.tensor([prompt_ids + gen_ids[:-1]])
        with torch.inference_mode():
            logits = self.model(input_ids=seq).logits[0, len(prompt_ids) - 1:].float()
        picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(gen_ids)[:, None])
        return picked[:, 0].tolist()

    def close(self) -> None:
        self.model = None


def load_system(key: str, model_path: str, threads: int, tokenizer: Any, log: Callable[[str], None]) -> System:
    if key in TIERS:
        return VerispecSystem(TIERS[key])
    if key == "hf":
        return HFSystem(model_path, tokenizer)
    if key == "llamacpp":
        return LlamaCppSystem(model_path, threads, log)
    raise ValueError(f"unknown system {key!r}; choose from {', '.join([*TIERS, *PEERS])}")
