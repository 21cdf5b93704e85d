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


def guard(runner, monkeypatch):
    """Wraps the runner's device phase (drafting, forward, sampling/verification/scoring)."""
    calls = {"n": 0}
    targets = [(runner, "_sample"), (runner, "_score_prompts")]
    if runner.drafter is not None:
        targets += [(runner.drafter, "draft"), (runner.drafter, "observe")]
    for obj, attr in targets:
        original = getattr(obj, attr)

        def wrapped(*args, _original=original, **kwargs):
            calls["n"] += 1
            with host_reads_forbidden():
                return _original(*args, **kwargs)

        monkeypatch.setattr(obj, attr, wrapped)
    model = runner.model
    original_forward = model.forward

    def forward(*args, **kwargs):
        with host_reads_forbidden():
            return original_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    return calls


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("name", list(SPECS))
def test_step_reads_nothing_on_the_host_before_the_copy(tiny_llama, monkeypatch, name):
    spec = SPECS[name]
    if name == "draft_model":
        spec = dict(spec, model=tiny_llama)
    llm = LLM(tiny_llama, max_num_batched_tokens=16, block_size=4, speculative_config=spec)
    calls = guard(llm.engine.runner, monkeypatch)
    prompts = random_prompts(4, 5, 30, seed=80)
    params = [
        SamplingParams(temperature=0, max_tokens=30, logprobs=2, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=30, logprobs=3,
                       logprobs_mode="processed_logprobs", ignore_eos=True),
        # Penalties read draft values on the host in model drafters (documented); elsewhere they're free.
        SamplingParams(temperature=1.0, min_p=0.05, seed=2, max_tokens=30, ignore_eos=True,
                       **({"repetition_penalty": 1.2} if name in ("plain", "ngram") else {"min_tokens": 3})),
        SamplingParams(temperature=0, max_tokens=30, logprob_token_ids=[5, 6, 7], ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls["n"] > 0 and all(len(o.outputs[0].token_ids) == 30 for o in outs)
    if spec:
        assert llm.stats()["num_draft_tokens"] > 0


def test_the_guard_catches_a_host_read():
    with host_reads_forbidden(), pytest.raises(HostRead):
        torch.ones(2).sum().item()
