"""Every CPU capability this machine can execute runs the tests whose arithmetic depends on it.

torch dispatches its CPU kernels (the int4 matmul and its packing, oneDNN's matmuls, Inductor's
generated code) by capability, and verispec builds its own kernels at the same level. This
process runs at the machine's best level (or the one `ATEN_CPU_CAPABILITY` forced on the whole
run); each level below it, down to the portable build, reruns the capability-dependent modules in
a fresh interpreter with `ATEN_CPU_CAPABILITY` set, since torch reads it once at start-up. So an
AVX-512 machine also proves the AVX2 and portable paths an AVX2-only or older machine would run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verispec.models.kernel_compiler import build_levels
from verispec.models.loader import cache_dir

ROOT = Path(__file__).resolve().parent.parent
# Kernels (attention, the exact tier's matmul, the fast tier's packed matmul), torch's int4 kernels and the dense path, the fast
# tier's fidelity and speculation, logits against HF, and the compiled stack.
CAPABILITY_MODULES = ["test_cpu_kernels.py", "test_cpu_kernels_rowwise.py", "test_packed_linear.py", "test_gguf_blocks.py", "test_quant.py", "test_fast_tier.py", "test_llama.py", "test_compile.py"]
# Left to the best level, for time (the portable int4 kernel decodes about 10x slower): the chat
# sample's 256 decode rows (the long-prompt fidelity test measures prompt and decode rows at every
# level) and SmolLM2's speculative-vs-plain run (the tiny models' runs cover every drafter).
BEST_LEVEL_ONLY = ["test_fast_tier_meets_the_fidelity_bar_on_a_sample", "test_smollm2_fast_tier_speculative_equals_plain"]
# What the libraries under torch may use at each level.
LIBRARY_CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def levels_below(capability: str) -> list[str]:
    return [level.lower() for level in build_levels(capability)[1:]]


def test_levels_below_the_best_are_the_ones_rerun():
    assert levels_below("AVX512") == ["avx2", "default"]
    assert levels_below("AVX2") == ["default"]
    assert levels_below("DEFAULT") == []


@pytest.mark.parametrize("level", ["avx2", "default"])
def test_capability_dependent_tests_pass_at_a_lower_level(level):
    here = torch.backends.cpu.get_cpu_capability()
    if level not in levels_below(here):
        pytest.skip(f"this process runs at {here}: {level} is not a level below it (it is this one, "
                    f"or one this CPU cannot execute)")
    # Inductor's cache keys ignore the capability (models/compile.py): each level gets its own.
    # oneDNN (bf16 matmuls) and MKL (fp32 BLAS) pick their code by CPUID, not by torch's level:
    # capped too, so the sub-run runs what a CPU of that level would.
    env = dict(os.environ, ATEN_CPU_CAPABILITY=level, TORCHINDUCTOR_CACHE_DIR=str(cache_dir() / "inductor" / level),
               **LIBRARY_CAPS[level])
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == level.upper()
    modules = [str(ROOT / "tests" / m) for m in CAPABILITY_MODULES]
    deselect = " and ".join(f"not {name}" for name in BEST_LEVEL_ONLY)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", deselect, *modules], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(run.stdout.splitlines()[-40:])
    print(f"at {level}: {run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]}")
    assert run.returncode == 0, f"the tests at ATEN_CPU_CAPABILITY={level} failed:\n{tail}\n{run.stderr[-2000:]}"
