"""`LLM.score`: teacher-forced logprobs equal to the rollout's, bit for bit, in every mode.

The rollout samples (T=0.7, seeded) a batch of completions with their logprobs; scoring the same
completions under the same parameters must give every logprob dict exactly (`==` on floats), and
the same cumulative logprob. The processed modes include penalties, bad words and min_tokens,
whose rows depend on the completion so far: an inverse control scores them as plain prompt rows
and finds a difference.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

from verispec import LLM, SamplingParams
from verispec.engine.scoring import scoring_request
from verispec.core.request import Request

from conftest import random_prompts

ROLLOUT = dict(temperature=0.7, seed=3, max_tokens=40, logprobs=3)
HISTORY = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, min_tokens=6,
               bad_words=["t17 t18", "t40"], top_k=50, top_p=0.9)
CASES = {
    "raw": dict(logprobs_mode="raw_logprobs"),
    "processed": dict(logprobs_mode="processed_logprobs"),
    "processed_history": dict(logprobs_mode="processed_logprobs", **HISTORY),
    "processed_logits": dict(logprobs_mode="processed_logits", min_p=0.05, logit_bias={7: 3.0}),
}


def rollout_and_score(llm: LLM, params: SamplingParams, seed: int = 0, n: int = 12):
    prompts = random_prompts(n, 4, 40, seed=seed)
    outs = llm.generate(prompts, params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outs]
    return outs, llm.score(prompts, completions, params, use_tqdm=False)


def unequal_rows(outs, scores) -> int:
    return sum(a != b for o, s in zip(outs, scores) for a, b in zip(o.outputs[0].logprobs, s.logprobs))


def test_the_scoring_request_generates_one_token_and_keys_rows_that_see_the_history():
    rollout = SamplingParams(n=4, max_tokens=50, min_tokens=2, logprobs=5, stop=["x"], temperature=0.7)
    own, scored = scoring_request(rollout, [1, 2, 3], [4, 5], vocab_size=100)
    assert (own.n, own.max_tokens, own.min_tokens, own.stop, own.logprobs, own.prompt_logprobs) == (1, 1, 0, None, None, 5)
    assert own.temperature == 0.7 and scored.params is rollout and scored.start == 3
    assert scored.rows_key[:2] == ("scored", 3)  # min_tokens makes the rows depend on the completion
    plain = scoring_request(SamplingParams(temperature=0.7), [1, 2, 3], [4, 5], vocab_size=100)[1]
    assert plain.rows_key == () and plain.params.logprobs is None


@pytest.fixture(scope="module")
def exact(tiny_with_tokenizer):
    return LLM(tiny_with_tokenizer, dtype="float32", enforce_eager=True)


@pytest.mark.parametrize("case", list(CASES))
def test_score_equals_the_rollout_bit_for_bit(exact, case):
    params = SamplingParams(**ROLLOUT, **CASES[case])
    outs, scores = rollout_and_score(exact, params)
    assert sum(len(s.token_ids) for s in scores) > 300
    for o, s in zip(outs, scores):
        got = o.outputs[0]
        assert s.token_ids == got.token_ids and s.prompt_token_ids == o.prompt_token_ids
        assert s.logprobs == got.logprobs  # every token's dict: the token, its top 3, ranks, exactly
        assert s.cumulative_logprob == got.cumulative_logprob
        assert s.weight_version == o.weight_version and s.error is None


@pytest.mark.parametrize("variant", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}},
    {"enforce_eager": False},
    {"max_num_batched_tokens": 24, "enable_prefix_caching": False},
], ids=["ngram", "compiled", "chunked_no_cache"])
def test_score_equals_the_rollout_under_speculation_compiling_and_chunking(tiny_with_tokenizer, variant, monkeypatch):
    monkeypatch.setenv("VERISPEC_COMPILE", "1")
    llm = LLM(tiny_with_tokenizer, **({"dtype": "float32", "enforce_eager": True} | variant))
    assert llm.engine.wait_for_compiled_step() == (variant.get("enforce_eager") is False)
    outs, scores = rollout_and_score(llm, SamplingParams(**ROLLOUT, **CASES["processed_history"]), seed=1, n=8)
    assert unequal_rows(outs, scores) == 0


def test_inverse_control_rows_without_the_completion_as_history_differ(exact, monkeypatch):
    """Scored as plain prompt rows (no penalties, bad words or min_tokens), the same completions
    give other processed logprobs: the check above can fail."""
    from dataclasses import replace

    history_aware = Request.scored_rows
    monkeypatch.setattr(Request, "scored_rows",
                        lambda req, lo, hi: [replace(row, position_independent=True) for row in history_aware(req, lo, hi)])
    outs, scores = rollout_and_score(exact, SamplingParams(**ROLLOUT, **CASES["processed_history"]), seed=2)
    assert unequal_rows(outs, scores) > 0


def test_scored_rows_are_not_shared_with_plain_prompt_rows(exact):
    """The prefix cache keeps prompt rows; a plain prompt-logprobs request over the same tokens,
    first, must not hand its rows to the scored request (their processors differ)."""
    params = SamplingParams(**ROLLOUT, **CASES["processed_history"])
    prompts = random_prompts(4, 20, 40, seed=4)
    outs = exact.generate(prompts, params, use_tqdm=False)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    plain = SamplingParams(temperature=0.7, max_tokens=8, prompt_logprobs=3, logprobs_mode="processed_logprobs",
                           **HISTORY)  # the same processors; only the history differs
    plain_rows = [o.prompt_logprobs for o in exact.generate(full, plain, use_tqdm=False)]
    scores = exact.score(prompts, [list(o.outputs[0].token_ids) for o in outs], params, use_tqdm=False)
    assert unequal_rows(outs, scores) == 0
    assert any(rows[len(p):] != s.logprobs for rows, p, s in zip(plain_rows, prompts, scores))


def test_score_after_a_weight_update_follows_the_new_weights(exact, tiny_llama):
    """Scores carry the weight version they ran under and use the weights of that moment."""
    from safetensors.torch import load_file

    llm = LLM(tiny_llama, dtype="float32", enforce_eager=True)
    params = SamplingParams(**ROLLOUT)
    _, before = rollout_and_score(llm, params, n=3)
    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    llm.update_weights({k: v * 1.05 if k.endswith("mlp.down_proj.weight") else v for k, v in weights.items()}, "v1")
    after = llm.score([s.prompt_token_ids for s in before], [s.token_ids for s in before], params, use_tqdm=False)
    assert all(s.weight_version == "v1" for s in after)
    assert any(a.logprobs != b.logprobs for a, b in zip(after, before))
    outs, again = rollout_and_score(llm, params, n=3)
    assert unequal_rows(outs, again) == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(completions=[[]]), "completion"),
    (dict(completions=[[1, 10**6]]), "completion token ids"),
    (dict(completions=[[1], [2]]), "completions has 2 entries"),
    (dict(completions=[[1]], sampling_params=SamplingParams(structured_outputs={"regex": "a+"})), "structured_outputs"),
    (dict(completions=[[1]], sampling_params=SamplingParams(logprob_token_ids=[3])), "logprob_token_ids"),
])
def test_bad_input_is_a_value_error_naming_the_field(exact, kwargs, field):
    with pytest.raises(ValueError, match=field):
        exact.score([[5, 6, 7]], use_tqdm=False, **kwargs)
    assert not exact.engine.has_unfinished_requests()


def test_a_completion_reaching_max_model_len_is_refused(exact):
    with pytest.raises(ValueError, match="max_model_len"):
        exact.score([[5] * 1000], [[6] * 1048], use_tqdm=False)


@pytest.mark.slow
def test_the_fast_tier_scores_short_sequences_as_its_rollout(smollm2_path):
    """The default tier is batch-invariant on chunks of up to 64 rows (docs/rl.md)."""
    from verispec.models.tokenizer_cache import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    prompts = [tok.encode(f"Tell me one fact about the number {i}.") for i in range(6)]
    llm = LLM(enforce_eager=True, num_kv_blocks=256)
    params = SamplingParams(**(ROLLOUT | {"max_tokens": 32}), logprobs_mode="processed_logprobs", top_k=40)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score(prompts, [list(o.outputs[0].token_ids) for o in outs], params, use_tqdm=False)
    assert max(len(p) + len(s.token_ids) for p, s in zip(prompts, scores)) <= 64
    assert unequal_rows(outs, scores) == 0
