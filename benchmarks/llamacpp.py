"""llama-cpp-python as a benchmark peer: plain, and with its prompt-lookup drafter.

It runs the bundled GGUF file as is (Q4_1 weights, 8-bit activations in its dot products), so its
greedy text is compared with verispec's but is not expected to match everywhere.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

from benchmarks.system import (
    PEERS,
    PLAIN,
    SPEC,
    SPEC_K,
    Generation,
    PeerUnavailable,
    acceptance_from_lengths,
)
from benchmarks.prompts import Prompt

# Context of the plain instance: room for the ~2k-token TTFT prompt. The speculative instance is
# sized to its prompts instead, because it keeps logits for every position (n_ctx x 49152 floats).
PLAIN_CTX = 4096

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
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:
            raise PeerUnavailable(
                f"llama-cpp-python is not installed ({exc}); `{PEERS['llamacpp'].install}`"
            ) from exc
        self.llama_cpp = llama_cpp
        self.llama_module = llama_module
        self.model_path = model_path
        self.threads = threads
        self.amx = _amx_kernels_work(model_path)
        if not self.amx:
            log("llama.cpp: AMX kernels crash on this CPU (advertised, not enabled); using its AVX kernels")

        class CountingLookup(LlamaPromptLookupDecoding):
            """llama.cpp's own prompt-lookup drafter, logging (sequence length, drafts) per call."""

            def __init__(self, num_pred_tokens: int) -> None:
                super().__init__(num_pred_tokens=num_pred_tokens)
                self.calls: list[tuple[int, int]] = []

            def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
                drafts = super().__call__(input_ids, **kwargs)
                self.calls.append((int(input_ids.shape[0]), int(drafts.shape[0])))
                return drafts

        self.drafter = CountingLookup(SPEC_K)
        self.llm = self._load(PLAIN_CTX, None)
        self.spec_llm: Any = None
        self.spec_ctx = 0
        vocab = self.llm._model.vocab
        # Forbid every end-of-generation token: llama.cpp stops on any of them, not just EOS.
        self.no_eog = {
            t: float("-inf") for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)
        }

    def _load(self, n_ctx: int, draft_model: Any) -> Any:
        kwargs: dict[str, Any] = {
            "model_path": self.model_path, "n_ctx": n_ctx, "n_threads": self.threads, "verbose": False,
            "seed": 0, "draft_model": draft_model,
            # With a draft model llama-cpp-python keeps every position's logits, but it sizes that
            # buffer from the logits_all argument, not from the draft model: without this its
            # eval overflows the buffer on any prompt longer than n_batch (512 tokens).
            "logits_all": draft_model is not None,
        }
        if self.amx:
            return self.llama_cpp.Llama(**kwargs)
        # Llama() has no switch for extra buffer types, so patch its default model params briefly.
        original = self.llama_module.llama_cpp.llama_model_default_params

        def without_extra_bufts() -> Any:
            params = original()
            params.use_extra_bufts = False
            return params

        self.llama_module.llama_cpp.llama_model_default_params = without_extra_bufts
        try:
            return self.llama_cpp.Llama(**kwargs)
        finally:
            self.llama_module.llama_cpp.llama_model_default_params = original

    def variant_label(self, variant: str) -> str:
        return self.label if variant == PLAIN else f"{self.label} + prompt lookup"

    def _engine(self, variant: str, need_ctx: int) -> Any:
        if variant == PLAIN:
            if need_ctx > PLAIN_CTX:
                raise ValueError(f"llama.cpp context is {PLAIN_CTX} tokens; this scenario needs {need_ctx}")
            return self.llm
        if self.spec_llm is None or need_ctx > self.spec_ctx:
            if self.spec_llm is not None:
                self.spec_llm.close()
            self.spec_ctx = -(-need_ctx // 256) * 256
            self.spec_llm = self._load(self.spec_ctx, self.drafter)
        return self.spec_llm

    def generate(self, prompts: list[Prompt], max_tokens: int, variant: str = PLAIN,
                 logprobs: int | None = None) -> Generation:
        llm = self._engine(variant, max(len(p.ids) for p in prompts) + max_tokens + SPEC_K + 1)
        texts, lengths = [], []
        steps = tokens = 0
        for p in prompts:  # no batching in llama-cpp-python: one request after another
            # Drop the cached prefix: the other systems recompute every prompt, so must this one.
            llm.reset()
            self.drafter.calls.clear()
            # The prompt's token ids, not its text: every system starts from the very same tokens.
            res = llm.create_completion(
                p.ids, max_tokens=max_tokens, temperature=0.0, top_k=1, repeat_penalty=1.0, logit_bias=self.no_eog
            )
            texts.append(res["choices"][0]["text"])
            lengths.append(int(res["usage"]["completion_tokens"]))
            if variant == SPEC:
                s, t = acceptance_from_lengths(self.drafter.calls, len(p.ids) + lengths[-1])
                steps, tokens = steps + s, tokens + t
        gen = Generation(texts, None, lengths)
        if variant == SPEC:
            gen.spec_steps, gen.spec_tokens = steps, tokens
        return gen

    def close(self) -> None:
        for llm in (self.llm, self.spec_llm):
            if llm is not None:
                llm.close()
        self.llm = self.spec_llm = None
