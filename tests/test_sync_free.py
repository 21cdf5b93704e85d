"""Nothing between the forward and the step's single D2H copy reads a device value on the host.

On the CPU there is no real synchronisation to catch, so the test makes every host read of a
tensor raise while the runner is inside the forward, the processing, sampling, verification and
logprob scoring; reads after the copy (`tolists`, the token lists) stay allowed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import random_prompts
from verispec import LLM, SamplingParams

_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def host_reads_forbidden():
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def forbid(name):
        def read(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name}() inside the step, before the D2H copy")
        return read

    try:
        for name in _READS:
            setattr(torch.Tensor, name, forbid(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def step_targets(runner) -> list[tuple[object, str]]:
    """The device phase of a step: building the spec-decode metadata, the forward, prompt
    scoring, verification (every sampled row) and a model drafter's drafting."""
    import verispec.worker.runner as runner_mod

    targets = [(runner_mod.SpecDecodeMetadata, "build"), (runner, "_forward"), (runner, "_score_prompts"),
               (runner_mod, "verify")]
    if runner.drafter is not None:
        targets += [(runner.drafter, "draft"), (runner.drafter, "observe")]
    return targets


def guard(runner, monkeypatch):
    """Wraps the runner's device phase (drafting, forward, sampling/verification/scoring)."""
    calls = {"n": 0}
    for obj, attr in step_targets(runner):
        original = getattr(obj, attr)

        def wrapped(*args, _original=original, **kwargs):
            calls["n"] += 1
            with host_reads_forbidden():
                return _original(*args, **kwargs)

        monkeypatch.setattr(obj, attr, wrapped)
    return calls


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    # Host drafts with their own probabilities as q: the rejection sampler's q rule on the device.
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}
# Adaptive verification: capacities decided on the device, verification in chunks of 3 rows.
ADAPTIVE = {"adaptive_verification": True, "cost_table": [[1, 1.0], [64, 2.3], [256, 22.0]],
            "max_verify_rows_per_chunk": 3}
SPECS.update({f"{name}_adaptive": dict(SPECS[name], **ADAPTIVE)
              for name in ("ngram", "layer_skip", "draft_model", "suffix")})


@pytest.mark.parametrize("name", list(SPECS))
def test_step_reads_nothing_on_the_host_before_the_copy(tiny_with_tokenizer, monkeypatch, name):
    spec = SPECS[name]
    if name.startswith("draft_model"):
        spec = dict(spec, model=tiny_with_tokenizer)
    llm = LLM(tiny_with_tokenizer, max_num_batched_tokens=16, block_size=4, speculative_config=spec)
    calls = guard(llm.engine.runner, monkeypatch)
    prompts = random_prompts(4, 5, 30, seed=80)
    params = [
        SamplingParams(temperature=0, max_tokens=30, logprobs=2, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=30, logprobs=3,
                       logprobs_mode="processed_logprobs", ignore_eos=True),
        # Penalties and bad words read a model drafter's drafts on the device.
        SamplingParams(temperature=1.0, min_p=0.05, seed=2, max_tokens=30, ignore_eos=True, repetition_penalty=1.2,
                       frequency_penalty=0.3, bad_words=["t5 t7", "t9"], min_tokens=3),
        SamplingParams(temperature=0, max_tokens=30, logprob_token_ids=[5, 6, 7], ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls["n"] > 0 and all(len(o.outputs[0].token_ids) == 30 for o in outs)
    if spec:
        assert llm.stats()["num_draft_tokens"] > 0
    if name.endswith("_adaptive"):
        assert llm.stats()["adaptive"]["admitted_total"] > 0


def test_the_guard_catches_a_host_read():
    with host_reads_forbidden(), pytest.raises(HostRead):
        torch.ones(2).sum().item()


# Modules whose code runs between scheduling and the step's one D2H copy.
STEP_MODULES = ["worker/runner.py", "models/attention.py", "models/llama.py", "sample/logprobs.py",
                "sample/metadata.py", "sample/noise.py", "sample/processors.py", "sample/prompt_logprobs.py",
                "sample/sampler.py", "spec_decode/adaptive.py", "spec_decode/drafter.py",
                "spec_decode/metadata.py", "spec_decode/rejection.py", "spec_decode/verify.py"]


def test_host_values_reach_the_device_through_pinned_copies():
    """A CUDA copy from pageable memory synchronises; the step builds device tensors from host
    values only through `to_device` (pinned, non-blocking). A direct `torch.tensor(..., device=)`
    in the step's modules is caught here, on any machine."""
    import ast
    from pathlib import Path

    import verispec

    root = Path(verispec.__file__).parent
    offenders = []
    for rel in STEP_MODULES:
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "tensor"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and any(k.arg == "device" for k in node.keywords)):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["plain", "ngram_adaptive", "layer_skip_adaptive", "draft_model_adaptive", "suffix",
                                  "suffix_adaptive"])
def test_cuda_step_passes_sync_debug_mode_error(tiny_llama, monkeypatch, name):
    """On CUDA, the device phase of a step (drafting, forward, verification, scoring) runs under
    torch.cuda.set_sync_debug_mode("error"): any synchronising call raises."""
    spec = SPECS[name]
    if name.startswith("draft_model"):
        spec = dict(spec, model=tiny_llama)
    llm = LLM(tiny_llama, device="cuda", max_num_batched_tokens=16, block_size=4, speculative_config=spec)
    runner = llm.engine.runner
    for obj, attr in step_targets(runner):
        original = getattr(obj, attr)

        def wrapped(*args, _original=original, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        monkeypatch.setattr(obj, attr, wrapped)
    prompts = random_prompts(4, 5, 30, seed=81)
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=24, logprobs=3,
                             logprobs_mode="processed_logprobs", ignore_eos=True)] * 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    if spec:
        assert llm.stats()["num_draft_tokens"] > 0
