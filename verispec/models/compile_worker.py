"""`python -m verispec.models.compile_worker SPEC [SHARE SHARES]`: the compiling half of the engine's
background compile.

It builds the model the engine described (`CompileSource`: the same file, precision and drafter
taps), compiles its share of the layer graphs (graphs SHARE, SHARE + SHARES, ...; all by default:
the engine runs one worker per share side by side) into Inductor's on-disk cache at low priority,
saves them, and exits; the engine marks the set complete once every worker has. The
engine's own build then finds every graph in the cache and only traces (models/compile.py). A
process of its own, not a thread: Inductor's code generation is Python that would hold the
engine's interpreter lock for tens of seconds while the eager steps answer, and a process can be
stopped at any moment, where a thread inside torch cannot.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from verispec.models.compile import CompileSource, LayerGraphs
from verispec.models.llama import LlamaModel
from verispec.models.loader import load_checkpoint
from verispec.models.packed_cache import layouts_for


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    source = CompileSource(**json.loads(args[0]))
    share, shares = (int(args[1]), int(args[2])) if len(args) >= 3 else (0, 1)
    if not source.save_to:
        raise SystemExit("compile_worker: the spec names no directory to save the graphs to")
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 10)  # as the engine set it (and where it could not)
    except OSError:
        pass
    torch.set_num_threads(1)  # the graph's C++ does not depend on it, and the engine's threads keep the cores
    dtype = getattr(torch, source.dtype)
    cfg, weights = load_checkpoint(source.model, dtype, source.quantization)
    cfg.rope_context = source.rope_context
    with layouts_for(source.model, "cpu"):  # the engine's start saved them
        model = LlamaModel(cfg, weights, dtype=dtype, device="cpu").eval()
    del weights
    model.capture_layers = tuple(source.capture_layers)
    graphs = LayerGraphs(model, source.block_size, source.max_tokens)
    save = Path(source.save_to)
    save.mkdir(parents=True, exist_ok=True)
    graphs.build_share(save, share, shares)
    return 0


if __name__ == "__main__":
    sys.exit(main())
