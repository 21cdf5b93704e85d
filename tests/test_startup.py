"""The engine's start-up report (verispec/engine/startup.py): tier names for each precision, the one
line and the metric labels `RuntimeInfo` gives, and `StartupLog`'s phase timings, measured against
known sleeps."""

from __future__ import annotations

import time

import pytest
import torch

from verispec.engine.startup import RuntimeInfo, StartupLog, tier_name


@pytest.mark.parametrize("dtype, quantization, tier", [
    (torch.float32, None, "exact"), (torch.bfloat16, None, "dense bf16"), (torch.float16, None, "float16"),
    (torch.float32, "gguf", "exact on codes"), (torch.bfloat16, "gguf", "fast"), (torch.bfloat16, "int4", "int4"),
])
def test_each_precision_has_its_tier_name(dtype, quantization, tier):
    assert tier_name(dtype, quantization) == tier


def test_the_line_and_the_labels_say_the_same_things():
    info = RuntimeInfo.of(torch.bfloat16, "gguf", torch.device("cpu"), compiled=True)
    assert info.precision == "bfloat16 + gguf" and info.step == "compiled"
    assert info.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert info.line() == (f"verispec: fast tier (bfloat16 + gguf) on {info.cpu_capability}, kernels {info.kernels}, "
                           "compiled step")
    assert info.labels() == {"tier": "fast", "precision": "bfloat16 + gguf", "cpu_capability": info.cpu_capability,
                             "kernels": info.kernels, "step": "compiled", "weights": ""}
    kinds = RuntimeInfo.of(torch.bfloat16, "gguf", torch.device("cpu"), compiled=False,
                           weights="Q4_K, Q6_K; IQ4_XS re-quantized to 8 bits")
    assert kinds.line().startswith("verispec: fast tier (bfloat16 + gguf: Q4_K, Q6_K; IQ4_XS re-quantized to 8 bits) on ")
    assert kinds.labels()["weights"] == "Q4_K, Q6_K; IQ4_XS re-quantized to 8 bits"


def test_on_a_gpu_the_capability_is_the_device_and_the_kernels_torchs():
    info = RuntimeInfo.of(torch.float32, None, torch.device("cuda"), compiled=False)  # nothing runs on it
    assert (info.cpu_capability, info.kernels, info.step) == ("cuda", "torch (CUDA)", "eager")


def test_phases_are_timed_in_order_even_when_one_fails():
    log = StartupLog()
    with log.phase("weights"):
        time.sleep(0.05)
    with pytest.raises(RuntimeError):
        with log.phase("tokenizer"):
            raise RuntimeError("no tokenizer")
    assert [name for name, _ in log.phases] == ["weights", "tokenizer"]
    assert 0.05 <= log.phases[0][1] < 1.0
    assert log.summary().startswith("engine started in ") and "weights 0.1 s" in log.summary()
