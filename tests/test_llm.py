"""The offline API (verispec/entrypoints/llm.py) on the tiny llama: the prompt shapes it accepts and
refuses (errors that say what was wrong), one SamplingParams or one per prompt, outputs in prompt
order, and a rejected batch leaving nothing queued. The model's tokens are the engine's concern
(test_llm_engine.py); here greedy runs of one prompt are the reference."""

from __future__ import annotations

import pytest

from verispec import LLM, SamplingParams
from verispec.entrypoints.llm import LLM as LLMFromModule

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama)


def test_the_package_exports_this_class():
    assert LLM is LLMFromModule


@pytest.mark.parametrize("prompts, expected", [
    ([5, 6, 7], [[5, 6, 7]]),  # one tokenized prompt
    ([[5, 6], [7]], [[5, 6], [7]]),
    ({"prompt_token_ids": (5, 6)}, [[5, 6]]),
    ([{"prompt": "a b"}, "c"], ["a b", "c"]),
])
def test_prompt_shapes_normalize_to_a_list(prompts, expected):
    assert LLM._normalize_prompts(prompts) == expected


@pytest.mark.parametrize("prompts, message", [
    ({"text": "x"}, "needs 'prompt' or 'prompt_token_ids'"),
    ([[5, True]], "strings or lists of token ids"),  # a bool is no token id
    (5, "got int"),
])
def test_bad_prompt_shapes_say_what_is_wrong(prompts, message):
    with pytest.raises(ValueError, match=message):
        LLM._normalize_prompts(prompts)


def test_outputs_come_in_prompt_order_and_equal_single_runs(llm):
    prompts = [[5, 6, 7], [9, 10], [30, 31, 32, 33]]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in together] == prompts
    assert [o.outputs[0].token_ids for o in together] == alone


def test_one_params_per_prompt_must_match_the_prompt_count(llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)
    short, long_ = llm.generate([[5], [6]], [GREEDY, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)],
                                use_tqdm=False)
    assert (len(short.outputs[0].token_ids), len(long_.outputs[0].token_ids)) == (4, 6)


def test_a_bad_prompt_leaves_no_half_added_batch(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [5, 10**6]], GREEDY, use_tqdm=False)  # the second is outside the vocabulary
    assert not llm.engine.has_unfinished_requests()


def test_chat_without_a_tokenizer_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
