"""What an engine says when it starts: what it runs on, in one line, and where its start-up time went.

`RuntimeInfo` names the precision tier, the CPU capability torch dispatches to and the kernels the
engine runs on; the CLI prints it, the server logs it and `/metrics` carries it as labels of
`verispec:runtime_info`. `StartupLog` times the phases (weights, tokenizer, kernels, compile).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from verispec.models.cpu_kernels import kernel_build


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    tier: str  # "exact", "exact on codes", "fast", "dense bf16", "int4", ...
    precision: str  # dtype and quantization, as configured
    cpu_capability: str  # torch's CPU dispatch level (ATEN_CPU_CAPABILITY can lower it); "cuda" on a GPU
    kernels: str  # "verispec AVX512", or "off (why)"
    compiled: bool
    weights: str = ""  # the quantized formats, as loader.weight_kinds says them ("Q4_K, Q6_K")

    @classmethod
    def of(cls, dtype: torch.dtype, quantization: str | None, device: torch.device, compiled: bool,
           weights: str = "") -> "RuntimeInfo":
        on_cpu = device.type == "cpu"
        return cls(
            tier=tier_name(dtype, quantization),
            precision=f"{str(dtype).removeprefix('torch.')}{' + ' + quantization if quantization else ''}",
            cpu_capability=torch.backends.cpu.get_cpu_capability() if on_cpu else device.type,
            kernels=kernel_build().describe() if on_cpu else "torch (CUDA)",
            compiled=compiled,
            weights=weights,
        )

    @property
    def step(self) -> str:
        return "compiled" if self.compiled else "eager"

    def line(self) -> str:
        weights = f": {self.weights}" if self.weights else ""
        return (f"verispec: {self.tier} tier ({self.precision}{weights}) on {self.cpu_capability}, "
                f"kernels {self.kernels}, {self.step} step")

    def labels(self) -> dict[str, str]:
        return {"tier": self.tier, "precision": self.precision, "cpu_capability": self.cpu_capability,
                "kernels": self.kernels, "step": self.step, "weights": self.weights}


def tier_name(dtype: torch.dtype, quantization: str | None) -> str:
    if quantization == "gguf":
        return "exact on codes" if dtype == torch.float32 else "fast"
    if quantization:
        return quantization
    return {torch.float32: "exact", torch.bfloat16: "dense bf16"}.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(slots=True)
class StartupLog:
    """Seconds per start-up phase, in the order they ran."""

    phases: list[tuple[str, float]] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases.append((name, time.perf_counter() - start))

    def summary(self) -> str:
        total = sum(t for _, t in self.phases)
        return f"engine started in {total:.1f} s: " + ", ".join(f"{name} {t:.1f} s" for name, t in self.phases)
