"""The model runner: a step is a function of the scheduler's output and the model state."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from test_adaptive import adaptive
from test_spec_decode import repetitive_prompts
from verispec import LLM, SamplingParams
from verispec.core.step_types import StepResult


def snapshot(sched) -> list:
    """What the runner reads of a step: per request its new tokens, drafts and prompt rows."""
    return [(s.request.request_id, s.num_new_tokens, s.samples, list(s.draft_token_ids)) for s in sched.scheduled] + [
        None if sched.plan is None else (sched.plan.budget, copy.deepcopy(sched.plan.calibration))]


def same_result(a: StepResult, b: StepResult) -> bool:
    if a.requests.keys() != b.requests.keys():
        return False
    for rid, x in a.requests.items():
        y = b.requests[rid]
        if (x.sampled, x.num_verified, x.num_accepted, x.draft_confidence) != (
                y.sampled, y.num_verified, y.num_accepted, y.draft_confidence):
            return False
        for lx, ly in ((x.logprobs, y.logprobs), (x.prompt_logprobs and x.prompt_logprobs[1],
                                                  y.prompt_logprobs and y.prompt_logprobs[1])):
            if (lx is None) != (ly is None):
                return False
            if lx is not None and not (np.array_equal(lx.logprobs, ly.logprobs)
                                       and np.array_equal(lx.logprob_token_ids, ly.logprob_token_ids)):
                return False
    return True


@pytest.mark.parametrize("method", ["ngram", "layer_skip"])
def test_a_step_run_twice_computes_the_same_and_leaves_its_input_alone(tiny_llama, method):
    """The engine's crash isolation runs a step's requests again: that must recompute the same
    step (the drafts the scheduler decided, once), not plan it a second time."""
    spec = adaptive({"method": method, "prompt_lookup_min": 1} if method == "ngram" else
                    {"method": method, "num_layers": 1})
    prompts = repetitive_prompts(6, seed=90)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    once = LLM(tiny_llama, speculative_config=spec)
    expected = once.generate(prompts, params, use_tqdm=False)

    llm = LLM(tiny_llama, speculative_config=spec)
    runner = llm.engine.runner
    execute, checked = runner.execute, []

    def twice(sched):
        before = snapshot(sched)
        first = execute(sched)
        assert snapshot(sched) == before  # the runner never changes the scheduler's output
        second = execute(sched)
        assert same_result(first, second)
        checked.append(any(s.draft_token_ids for s in sched.scheduled))
        return first

    runner.execute = twice
    out = llm.generate(prompts, params, use_tqdm=False)
    assert any(checked)  # some of the doubled steps verified drafts
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in expected]
    # The plan ran once per step: the statistics are those of the run that executed each step once.
    assert llm.stats()["adaptive"] == once.stats()["adaptive"]
