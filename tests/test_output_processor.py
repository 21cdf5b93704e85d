"""The output processor on its own: incremental text against the tokenizer's full decode, stop
tokens and stop strings, held-back UTF-8, and the work per token."""

from __future__ import annotations

import random

import pytest

from verispec import SamplingParams
from verispec.config import LogprobsMode
from verispec.engine.output_processor import OutputProcessor
from verispec.core.request import Request, RequestStatus
from verispec.sample.noise import RequestNoise

EOS = 2
PROMPT = [1, 17, 42]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from verispec.models.tokenizer_cache import load_tokenizer

    return load_tokenizer(smollm2_path)


def make_request(params: SamplingParams, max_tokens: int = 1000) -> Request:
    stop_ids = frozenset(params.stop_token_ids or ()) | ({EOS} if not params.ignore_eos else set())
    return Request(request_id="r", prompt=None, prompt_token_ids=list(PROMPT), params=params,
                   logprobs_mode=LogprobsMode.RAW_LOGPROBS, noise=RequestNoise(0), stop_ids=stop_ids,
                   max_tokens=max_tokens)


def feed(proc: OutputProcessor, req: Request, ids: list[int]) -> list[str]:
    """Adds the request, then appends ids one step at a time (until the request finishes); returns
    the text after each step."""
    proc.add(req)
    texts = []
    for tok in ids:
        if req.is_finished:
            break
        proc.append_tokens(req, [tok], None)
        texts.append(proc.state(req).text)
    return texts


def _sequences(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    multibyte = tokenizer.encode("naïve café, 日本語のテキスト 😀🎉 and ünïcödé " * 2)
    vocab = len(tokenizer)
    return [multibyte] + [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(40)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_is_always_a_prefix_of_the_full_decode_and_equals_it_at_the_end(tokenizer, skip_special_tokens):
    proc = OutputProcessor(tokenizer, max_model_len=10_000)
    for ids in _sequences(tokenizer):
        params = SamplingParams(ignore_eos=True, skip_special_tokens=skip_special_tokens)
        req = make_request(params, max_tokens=len(ids))
        texts = feed(proc, req, ids)
        for i, text in enumerate(texts[:-1]):
            full = tokenizer.decode(ids[: i + 1], skip_special_tokens=skip_special_tokens)
            assert full.startswith(text)  # what is held back is only the tail still being completed
            assert not text.endswith("\ufffd")  # an unfinished character is never shown while running
            assert text.startswith(texts[i - 1] if i else "")  # text only grows
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_text_decodes_no_whole_output(tokenizer, monkeypatch):
    proc = OutputProcessor(tokenizer, max_model_len=10_000)
    calls = []
    monkeypatch.setattr(proc, "decode", lambda ids, skip: calls.append(len(ids)) or tokenizer.decode(ids))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)
    req = make_request(SamplingParams(ignore_eos=True), max_tokens=len(ids))
    feed(proc, req, ids)
    assert proc.state(req).text == tokenizer.decode(ids) and calls == []


def test_stop_token_ends_the_text_before_it_and_names_itself(tokenizer):
    proc = OutputProcessor(tokenizer, max_model_len=10_000)
    ids = tokenizer.encode("Hello there, friend")
    custom = ids[2]
    req = make_request(SamplingParams(stop_token_ids=[custom]))
    feed(proc, req, ids)
    assert req.status == RequestStatus.FINISHED_STOPPED and proc.state(req).stop_reason == custom
    assert proc.state(req).text == tokenizer.decode(ids[:2]) and req.output_token_ids == ids[:3]
    eos = make_request(SamplingParams())
    feed(proc, eos, ids[:2] + [EOS] + ids[2:])
    assert proc.state(eos).stop_reason is None and proc.state(eos).text == tokenizer.decode(ids[:2])
    early = make_request(SamplingParams(min_tokens=3))  # EOS before min_tokens is just a token
    feed(proc, early, [EOS] + ids)
    assert early.num_output_tokens > 1


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_stops_at_the_token_that_completes_it(tokenizer, include):
    proc = OutputProcessor(tokenizer, max_model_len=10_000)
    ids = tokenizer.encode("alpha beta gamma delta epsilon")
    req = make_request(SamplingParams(stop=["a gam"], include_stop_str_in_output=include))
    feed(proc, req, ids)
    full = tokenizer.decode(ids)
    cut = full.index("a gam")
    assert req.status == RequestStatus.FINISHED_STOPPED and proc.state(req).stop_reason == "a gam"
    assert proc.state(req).text == (full[: cut + len("a gam")] if include else full[:cut])
    # It stopped at the first token whose text completes the stop string, not later.
    done = req.output_token_ids
    assert "a gam" in tokenizer.decode(done) and "a gam" not in tokenizer.decode(done[:-1])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_a_multi_token_step_drops_the_steps_later_tokens(tokenizer, include):
    """Accepted drafts arrive several to a step: the output still ends at the token that completes
    the stop string, as one token at a time would, with its logprobs cut alike."""
    ids = tokenizer.encode("alpha beta gamma delta epsilon")
    one = make_request(SamplingParams(stop=["a gam"], include_stop_str_in_output=include))
    feed(first := OutputProcessor(tokenizer, max_model_len=10_000), one, ids)
    many = make_request(SamplingParams(stop=["a gam"], include_stop_str_in_output=include))
    second = OutputProcessor(tokenizer, max_model_len=10_000)
    second.add(many)
    second.append_tokens(many, ids, None)
    assert many.output_token_ids == one.output_token_ids and len(many.output_token_ids) < len(ids)
    assert second.state(many).text == first.state(one).text and second.state(many).stop_reason == "a gam"


def test_an_output_ending_inside_a_character_shows_its_bytes_at_the_end(tokenizer):
    proc = OutputProcessor(tokenizer, max_model_len=10_000)
    ids = tokenizer.encode("😀🎉")
    for n in range(1, len(ids) + 1):
        req = make_request(SamplingParams(ignore_eos=True), max_tokens=n)
        texts = feed(proc, req, ids)
        assert texts[-1] == tokenizer.decode(ids[:n])  # as the full decode: U+FFFD for a cut character
        assert all(not t.endswith("\ufffd") for t in texts[:-1])
