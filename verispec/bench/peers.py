"""The systems the benchmark times: verispec itself and the optional peers (HF, llama.cpp).

Each system takes the same prompts and returns what it generated, greedy, with end-of-sequence
forbidden so that every system produces exactly `max_tokens` tokens per prompt. Forbidding EOS
(rather than generating through it) is the one behaviour all three can express: HF's
`min_new_tokens` masks EOS, llama.cpp always stops at an end-of-generation token, so verispec
uses `min_tokens` (same masking) instead of bare `ignore_eos`, which would let it emit EOS and keep
going and make its ids diverge from HF's after the first EOS.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from verispec.bench.prompts import Prompt


class PeerUnavailable(RuntimeError):
    """An optional peer is not installed; the message says how to install it."""


@dataclass(slots=True)
class Generation:
    texts: list[str]
    token_ids: list[list[int]] | None  # None where the system's ids are not verispec's vocabulary/view
    lengths: list[int]  # tokens actually produced per prompt


class System(Protocol):
    key: str
    label: str
    compare: str  # "ids" or "text": what its output is compared to verispec's on

    def generate(self, prompts: list[Prompt], max_tokens: int) -> Generation: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------- verispec
class VerispecSystem:
    key, label, compare = "verispec", "verispec", "ids"

    def __init__(self) -> None:
        from verispec import LLM

        # No arguments: the bundled default model in fp32, on torch's thread count (set by the runner).
        self.llm = LLM()

    def generate(self, prompts: list[Prompt], max_tokens: int, logprobs: int | None = None) -> Generation:
        from verispec import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=logprobs)
        outs = self.llm.generate([{"prompt_token_ids": p.ids} for p in prompts], params, use_tqdm=False)
        seqs = [o.outputs[0] for o in outs]
        ids = [list(s.token_ids) for s in seqs]
        return Generation([s.text for s in seqs], ids, [len(i) for i in ids])

    def close(self) -> None:
        del self.llm


# ------------------------------------------------------------------------------------- HF
class HFSystem:
    key, label, compare = "hf", "HF transformers", "ids"

    def __init__(self, model_path: str, tokenizer: Any) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
        except ImportError as exc:
            raise PeerUnavailable(f"transformers is not installed ({exc}); `pip install transformers`") from exc
        # Its GGUF conversion bar and generation-flag warnings would drown the benchmark's own output.
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch = torch
        self.tokenizer = tokenizer
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
        ).eval()
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(self, prompts: list[Prompt], max_tokens: int) -> Generation:
        torch = self.torch
        # One left-padded batch: decoder-only models must have every row end at the same column.
        width = max(len(p.ids) for p in prompts)
        rows = [[self.pad] * (width - len(p.ids)) + p.ids for p in prompts]
        mask = [[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts]
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=torch.tensor(rows),
                attention_mask=torch.tensor(mask),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=self.pad,
            )
        ids = [row.tolist() for row in out[:, width:]]
        texts = [self.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
        return Generation(texts, ids, [len(i) for i in ids])

    def close(self) -> None:
        del self.model


# ------------------------------------------------------------------------------ llama.cpp
_AMX_PROBE = (
    "import sys, llama_cpp\n"
    "m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)\n"
    "m.create_completion(' hello' * 64, max_tokens=2)\n"
)


def _amx_kernels_work(model_path: str) -> bool:
    """Whether llama.cpp's AMX kernels run here; checked in a child because failure is SIGILL.

    Some VMs advertise AMX in CPUID without enabling its register state, and ggml then dies with
    an illegal instruction in its first prompt matmul (one-token prompts take another kernel, so
    the probe's prompt is long). Only CPUs that advertise AMX need the probe.
    """
    try:
        with open("/proc/cpuinfo") as f:
            if "amx_tile" not in f.read():
                return True
    except OSError:
        return True
    try:
        res = subprocess.run(
            [sys.executable, "-c", _AMX_PROBE, model_path], capture_output=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        return False
    return res.returncode == 0


class LlamaCppSystem:
    key, label, compare = "llamacpp", "llama.cpp", "text"

    def __init__(self, model_path: str, threads: int, log: Callable[[str], None]) -> None:
        try:
            import llama_cpp
            import llama_cpp.llama as llama_module
        except ImportError as exc:
            raise PeerUnavailable(
                f"llama-cpp-python is not installed ({exc}); `pip install llama-cpp-python`"
            ) from exc
        self.llama_cpp = llama_cpp
        kwargs: dict[str, Any] = {
            "model_path": model_path, "n_ctx": 2048, "n_threads": threads, "verbose": False, "seed": 0
        }
        if _amx_kernels_work(model_path):
            self.llm = llama_cpp.Llama(**kwargs)
        else:
            log("llama.cpp: AMX kernels crash on this CPU (advertised, not enabled); using its AVX kernels")
            # Llama() has no switch for extra buffer types, so patch its default model params briefly.
            original = llama_module.llama_cpp.llama_model_default_params

            def without_extra_bufts() -> Any:
                params = original()
                params.use_extra_bufts = False
                return params

            llama_module.llama_cpp.llama_model_default_params = without_extra_bufts
            try:
                self.llm = llama_cpp.Llama(**kwargs)
            finally:
                llama_module.llama_cpp.llama_model_default_params = original
        vocab = self.llm._model.vocab
        # Forbid every end-of-generation token: llama.cpp stops on any of them, not just EOS.
        self.no_eog = {
            t: float("-inf") for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)
        }

    def generate(self, prompts: list[Prompt], max_tokens: int) -> Generation:
        texts, lengths = [], []
        for p in prompts:  # no batching in llama-cpp-python: one request after another
            # Drop the cached prefix: the other systems recompute every prompt, so must this one.
            self.llm.reset()
            res = self.llm.create_completion(
                p.text, max_tokens=max_tokens, temperature=0.0, top_k=1, repeat_penalty=1.0, logit_bias=self.no_eog
            )
            texts.append(res["choices"][0]["text"])
            lengths.append(int(res["usage"]["completion_tokens"]))
        return Generation(texts, None, lengths)

    def close(self) -> None:
        self.llm.close()
        del self.llm


@dataclass(slots=True)
class PeerSpec:
    label: str
    install: str


PEERS: dict[str, PeerSpec] = {
    "hf": PeerSpec("HF transformers", "pip install transformers"),
    "llamacpp": PeerSpec("llama.cpp", "pip install llama-cpp-python"),
}


def load_system(key: str, model_path: str, threads: int, tokenizer: Any, log: Callable[[str], None]) -> System:
    if key == "verispec":
        return VerispecSystem()
    if key == "hf":
        return HFSystem(model_path, tokenizer)
    if key == "llamacpp":
        return LlamaCppSystem(model_path, threads, log)
    raise ValueError(f"unknown system {key!r}; choose from verispec, {', '.join(PEERS)}")
