"""The compiled layer stack: embedding, every decoder layer and the final norm as one Inductor graph.

Eager PyTorch pays a few microseconds of dispatch per op, and a decode step of a 30-layer model
runs about 1500 small ops: at batch 1 that costs as much as the int4 matmuls themselves. Compiled:
- Attention stays one opaque op (`verispec::attention`): its per-step structure (groups, block
  tables) lives in the attention context, so the graph sees only tensors and a layer index.
- The token count is an unbacked symbol: one graph serves every step of 1 to KERNEL_MAX_ROWS
  rows (decode, verify, short chunks), the 1-row step included. Longer steps (prefill chunks,
  where the matmuls dwarf the dispatch) run eager.
- No guards: each model's one graph is the only entry for its private copy of the code, so guard
  evaluation (more than half a millisecond per step) is filtered out; `warm_up` compiles the
  graph and runs it at the sizes that matter before the first request.
- Inductor's C++ wrapper calls the kernels from C++, not from a Python wrapper.
- Inductor rounds each bf16 intermediate as eager does (`emulate_precision_casts`), the bf16
  norms are verispec's op (Inductor's fused reduction sums in another order) and the rotary
  tables come in computed eager: a row gets the same bits in the graph and in a step too long for
  it, so batch invariance holds across the two paths.
- Inductor's on-disk cache lives under verispec's cache, one directory per CPU capability: its
  keys do not include `ATEN_CPU_CAPABILITY`, and C++ generated for AVX2 fails to build at the
  portable level (and AVX-512 code would not run on an AVX2 machine).
- `enforce_eager=True` (the default where the environment switches compiling off, verispec/envs.py),
  or a machine without a C++ compiler runs eager; so does CUDA for now (untested there, and CUDA graphs are what a GPU step needs).
"""

from __future__ import annotations

import logging
import os
import time
import types

import torch

from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.models.cpu_kernels import cxx_compiler
from verispec.models.linear import KERNEL_MAX_ROWS
from verispec.models.loader import cache_dir

logger = logging.getLogger("verispec.compile")


def compile_wanted(enforce_eager: bool, device: torch.device) -> bool:
    """Whether to compile: on a CPU with a C++ compiler, unless asked for eager."""
    if enforce_eager:  # the environment may make it the default (verispec/envs.py)
        return False
    if device.type != "cpu":  # not yet run on a GPU, where CUDA graphs are the lever: eager until it is
        return False
    if cxx_compiler() is None:
        logger.warning("no C++ compiler found: the model runs eager (slower); install g++ to compile it")
        return False
    return True


def inductor_cache_dir() -> str:
    """Inductor's cache for this process's CPU capability; a $TORCHINDUCTOR_CACHE_DIR of the
    user's own is kept. Inductor writes its shared default into the variable on first use, so
    that value is replaced too: it would mix the levels' code."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        level = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor" / level)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


class CompiledStack:
    """`model.stack` under torch.compile; called by `LlamaModel.forward` inside the attention context."""

    def __init__(self, model, max_tokens: int = KERNEL_MAX_ROWS):
        inductor_cache_dir()
        # Dynamo keeps compiled graphs (and their guards) on the function's code object. A copy of
        # the code per model gives each model one graph of its own, so that with guards skipped
        # two engines in one process can never pick each other's graph.
        stack = type(model).stack
        fn = types.FunctionType(stack.__code__.replace(), stack.__globals__, stack.__name__, stack.__defaults__)
        # No guards at all: this model's one graph serves every call `takes` admits (inference
        # tensors, up to max_tokens rows, the size symbolic), and checking ~300 weight tensors'
        # guards would cost more than half a millisecond per step.
        # emulate_precision_casts: fused bf16 ops round each intermediate as eager does, so a row
        # computes alike in the graph and in a longer step that runs eager (speculative output at
        # batch 32 equals plain output only with it).
        options = {"cpp_wrapper": True, "emulate_precision_casts": True,
                   "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
        self._fn = torch.compile(types.MethodType(fn, model), dynamic=True, options=options)
        self.max_tokens = max_tokens
        self.warm = False

    def takes(self, input_ids: torch.Tensor) -> bool:
        """Decode and verify steps; a prefill chunk's matmuls dwarf its per-op overhead: eager.
        The graph is built for inference tensors (the engine's); others run eager too."""
        return input_ids.shape[0] <= self.max_tokens and input_ids.is_inference()

    def __call__(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.warm:  # compiling: one graph whatever the size, 1 included (no 0/1 specialisation)
            torch._dynamo.decorators.mark_unbacked(input_ids, 0)
            for t in (cos, sin):  # [tables, T, 1, rotary dims]
                torch._dynamo.decorators.mark_unbacked(t, 1)
            # The model's float constants (norm eps, rope, attention scale) never change: traced
            # as symbols, they make Dynamo trace the whole stack a second time (a third of the
            # compile) to specialise them after all.
            with torch._dynamo.config.patch(specialize_float=True):
                return self._fn(input_ids, cos, sin)
        return self._fn(input_ids, cos, sin)


# The compile (2 tokens), then the sizes that must not recompile: one row, the most rows.
WARM_UP_SIZES = (2, 1, KERNEL_MAX_ROWS)


@torch.inference_mode()
def warm_up(model, kv_layers: list, block_size: int, num_blocks: int) -> None:
    """Compiles the graph before the first request. The dummy tokens write into free blocks (a
    block is always written before it is read), so the cache needs no cleaning afterwards."""
    compiled = model.compiled
    if compiled is None:
        return
    dev = model.embed.device
    start = time.perf_counter()
    logger.info("compiling the layer stack (about a minute the first time, seconds once cached; "
                "enforce_eager=True skips it)")
    for n in WARM_UP_SIZES:
        nb = -(-n // block_size)
        if nb > num_blocks:  # a tiny pool: the graph is the same, this size is just not rehearsed
            continue
        meta = build_attention_metadata([SeqSpan(0, n, n, list(range(nb)))], block_size, dev, model.dtype)
        model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), meta, kv_layers)
    compiled.warm = True
    logger.info("layer stack compiled and warmed up in %.1f s", time.perf_counter() - start)
