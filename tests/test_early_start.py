"""`verispec serve`'s early start: the cores launched and the tokenizer loaded before the web stack
is imported (entrypoints/openai/early_start.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from verispec.entrypoints.openai.early_start import load_tokenizer, start_early
from verispec.sample.grammar import GrammarCompiler


def test_the_early_tokenizer_builds_llguidance_for_the_compiler_that_comes_later(smollm2_path):
    """The head start is the compiler's own: a compiler for the same vocabulary and EOS finds it."""
    tokenizer, encoder = load_tokenizer(smollm2_path)
    assert encoder is not None and encoder.tokenizer is tokenizer
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    other = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    compiler.warm()
    other.warm()
    assert compiler._ll_tokenizer is other._ll_tokenizer  # built once, at the early start
    padded = GrammarCompiler(tokenizer, len(tokenizer) + 64, frozenset({tokenizer.eos_token_id}))
    padded.warm()
    assert padded._ll_tokenizer is not compiler._ll_tokenizer  # a core that differs gets its own


def test_start_early_launches_the_core_before_anything_awaits_it(tiny_with_tokenizer):
    """The core process runs from the call on; the lifespan's start only waits for its ready message."""
    from verispec.config import EngineConfig

    early = start_early(EngineConfig(model=tiny_with_tokenizer, enforce_eager=True, max_model_len=256), 1)
    try:
        pid = early.client.core_pid
        assert pid is not None and os.path.exists(f"/proc/{pid}")
        asyncio.run(early.client.start())
        assert early.client.ready is not None and early.client.ready.pid == pid
        tokenizer, _ = early.tokenizer.result(timeout=120)
        assert tokenizer is not None
    finally:
        asyncio.run(early.client.shutdown())


def test_serve_imports_no_web_stack_before_launching_its_core():
    """The order the speed depends on: `start_early` comes before FastAPI is imported."""
    code = ("import sys\nimport verispec.entrypoints.openai.early_start\n"
            "print('fastapi' in sys.modules, 'uvicorn' in sys.modules, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
