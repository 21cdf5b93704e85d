"""Grammars past the limits (sample/grammar.py, config.GrammarLimits): refused before anything is
queued, compiled once however often a client repeats them, and, where one fails inside a step,
failing only its own request. A tiny random llama carries SmolLM2's tokenizer (`tiny_tok`)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from verispec import LLM, SamplingParams
from verispec.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(tiny_tok):
    return LLM(tiny_tok, dtype="float32", max_logprobs=-1, num_kv_blocks=256)


def test_a_grammar_past_the_parser_limits_fails_its_request_alone(tiny_tok):
    """A mask that runs out of llguidance's per-step budget after the checks is an error for that
    request only, the client's (error_kind "invalid"); the rest of the batch carries on."""
    from verispec.config import GrammarLimits
    from verispec.sample.grammar import GrammarCompiler

    own = LLM(tiny_tok, dtype="float32", num_kv_blocks=64)
    eng = own.engine
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    compiler = eng.structured.compiler = GrammarCompiler(eng.tokenizer, eng.vocab_size, eng.eos_token_ids,
                                                         GrammarLimits(step_max_items=5))
    # A grammar the checks would refuse, planted in the compiled cache: it stands for one whose
    # first steps pass and a later one runs out.
    import llguidance

    from verispec.sample.grammar import _parser_limits

    text = json.dumps(schema, sort_keys=True)
    planted = concurrent.futures.Future()
    planted.set_result(llguidance.LLMatcher(compiler._tokenizer(), llguidance.grammar_from("json_schema", text),
                                            log_level=0, limits=_parser_limits(compiler.limits)))
    compiler._compiled[("json", text)] = planted
    outs = own.generate([[1, 5, 6], [1, 5, 7]], [
        SamplingParams(max_tokens=8, structured_outputs={"json": schema}),
        SamplingParams(max_tokens=4, temperature=0),
    ], use_tqdm=False)
    assert outs[0].error is not None and "structured output failed" in outs[0].error
    assert outs[0].error_kind == "invalid"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    assert not eng.has_unfinished_requests() and eng.pool.num_free_blocks == eng.pool.num_blocks


def test_a_sampled_token_the_grammar_refuses_fails_its_request_in_that_step(llm, monkeypatch):
    """llguidance's mask can offer a token its parser then refuses (partial UTF-8 of non-ASCII
    choices): the request fails in the step that sampled it, as the client's error, without the
    step's one-by-one re-run."""
    from verispec.sample.grammar import RequestGrammar

    eng = llm.engine
    follow = RequestGrammar.follow
    monkeypatch.setattr(RequestGrammar, "follow", lambda self, ids, num_prompt: follow(self, [5], 0))  # 5: refused
    runs, execute = [], eng.runner.execute
    monkeypatch.setattr(eng.runner, "execute", lambda sched: runs.append(sched) or execute(sched))
    eng.add_request("refused", [1, 5, 6], SamplingParams(max_tokens=6, structured_outputs={"choice": ["dark blue"]}))
    eng.add_request("plain", [1, 5, 7], SamplingParams(max_tokens=6, temperature=0))
    first = {out.request_id: out for out in eng.step()}
    assert len(runs) == 1  # the step ran once: no one-by-one re-run
    assert first["refused"].finished and first["refused"].error_kind == "invalid"
    assert "structured output failed" in first["refused"].error and first["plain"].error is None
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


REF_LOOP = {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"$ref": "#/definitions/a"}}}


@pytest.mark.parametrize("so, message", [
    ({"json": REF_LOOP}, "NoExtensionBias"),  # found by the first mask
    ({"regex": "(a{1000}){1000}"}, "too many expressions"),  # found one step later
    ({"choice": [f"item{i}" for i in range(1001)]}, "at most 1000"),  # GrammarLimits.max_choices
    ({"regex": "a" * ((128 << 10) + 1)}, "bytes; this server accepts at most"),  # GrammarLimits.max_bytes
])
def test_grammars_past_the_limits_are_refused_before_anything_is_queued(llm, so, message):
    eng = llm.engine
    with pytest.raises(ValueError, match=message):
        eng.add_request("hostile", [1, 5, 6], SamplingParams(max_tokens=4, structured_outputs=so))
    assert not eng.has_unfinished_requests()


def test_a_choice_row_past_llguidances_items_is_found_by_the_probe(tiny_tok):
    from verispec.config import GrammarLimits
    from verispec.models.tokenizer_cache import load_tokenizer
    from verispec.sample.grammar import GrammarCompiler, GrammarError

    compiler = GrammarCompiler(load_tokenizer(tiny_tok), 49152, frozenset({2}), GrammarLimits(max_choices=5000))
    with pytest.raises(GrammarError, match="items; max is 2000"):
        compiler.matcher(StructuredOutputsParams(choice=[f"item{i}" for i in range(3000)]))
    assert compiler.matcher(StructuredOutputsParams(choice=[f"item{i}" for i in range(1000)])) is not None


def test_a_grammar_that_fails_is_compiled_once_and_refused_alike_after(tiny_tok, monkeypatch):
    """A client repeating a grammar past the limits costs one compile: the error is kept beside
    the templates and raised afresh (same message) for the repeats; concurrent askers share one."""
    from verispec.models.tokenizer_cache import load_tokenizer
    from verispec.sample.grammar import GrammarCompiler, GrammarError

    compiler = GrammarCompiler(load_tokenizer(tiny_tok), 49152, frozenset({2}))
    compiles = []
    real = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda *a: compiles.append(a) or time.sleep(0.2) or real(*a))  # askers overlap
    bad = StructuredOutputsParams(regex="(a{1000}){1000}")
    messages = []
    for _ in range(3):
        with pytest.raises(GrammarError) as info:
            compiler.matcher(bad)
        messages.append(str(info.value))
    assert len(compiles) == 1 and len(set(messages)) == 1 and "regex" in messages[0]
    # Asked four times at once, a new grammar is compiled once; each asker gets its own matcher.
    good = StructuredOutputsParams(regex="[ab]{2}")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        matchers = list(pool.map(lambda _: compiler.matcher(good), range(4)))
    assert len(compiles) == 2 and len({id(m.matcher) for m in matchers}) == 4


def test_min_tokens_with_a_grammar_is_refused_and_a_refused_token_fails_only_its_request(llm):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs={"choice": ["a"]})
    # A token the grammar refuses (here forced in by hand) leaves the engine running.
    eng = llm.engine
    eng.add_request("bad", [1, 5, 6], SamplingParams(max_tokens=6, structured_outputs={"choice": ["dark blue"]}))
    eng.add_request("good", [1, 5, 7], SamplingParams(max_tokens=6, temperature=0))
    eng.step()
    bad = next(r for r in eng.scheduler.running if r.request_id == "bad")
    bad.grammar.follow(bad.token_ids + [5], bad.num_prompt_tokens)  # 5 is not a prefix of "dark blue"
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bad"].error is not None and done["good"].error is None
