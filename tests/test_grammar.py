"""Structured output (sample/grammar.py): grammar masks from llguidance, honest logprobs, and
lossless speculation.

Fast checks run a tiny random llama that carries SmolLM2's tokenizer (a grammar needs real
tokens); the schema acceptance run uses SmolLM2 itself. Grammars past the limits:
test_grammar_limits.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import fp32_tol, hf_model
from verispec import LLM, SamplingParams
from verispec.sampling_params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


ADAPTIVE = {**SPEC, "adaptive_verification": True, "cost_table": [[1, 0.01], [16, 0.012], [64, 0.03]]}


@pytest.fixture(scope="module")
def engines(tiny_tok):
    configs = {False: None, True: SPEC, "adaptive": ADAPTIVE}
    return {key: LLM(tiny_tok, dtype="float32", max_logprobs=-1, num_kv_blocks=256, speculative_config=spec)
            for key, spec in configs.items()}


def _allowed(tokenizer_path: str, so: StructuredOutputsParams, output: list[int], vocab: int) -> list[np.ndarray]:
    """An independent matcher's allowed-token sets after each prefix of `output`."""
    import llguidance
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer

    from verispec.sample.grammar import _FORMATS, _grammar_text

    tok = from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_path), n_vocab=vocab, eos_token=[2])
    m = llguidance.LLMatcher(tok, llguidance.grammar_from(_FORMATS[so.kind], _grammar_text(so)))
    sets = []
    for t in output:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab]
        sets.append(bits.astype(bool))
        m.consume_token(t)
    return sets


GRAMMARS = [
    StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."),
    StructuredOutputsParams(choice=["red", "green", "blue", "dark blue"]),
    StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                       "maximum": 99}},
                                  "required": ["n"], "additionalProperties": False}),
    StructuredOutputsParams(grammar='start: "yes" | "no" | "maybe" " " NUMBER\nNUMBER: /[0-9]{1,3}/'),
]


@pytest.mark.parametrize("so", GRAMMARS, ids=["regex", "choice", "json", "lark"])
def test_processed_logprobs_are_the_masked_distribution_and_raw_ones_the_model(engines, tiny_tok, so):
    """logprobs=-1 in processed mode: the allowed tokens' mass is 1 within 1e-5 and every other
    token is -inf; in raw mode the row is HF's unconstrained row for the same tokens."""
    llm = engines[False]
    prompt = [1, 9, 8, 7, 6, 5]
    base = dict(temperature=0.9, seed=4, max_tokens=12, logprobs=-1, structured_outputs=so)
    proc = llm.generate([prompt], SamplingParams(**base, logprobs_mode="processed_logprobs"), use_tqdm=False)[0]
    raw = llm.generate([prompt], SamplingParams(**base, logprobs_mode="raw_logprobs"), use_tqdm=False)[0]
    out = proc.outputs[0]
    assert raw.outputs[0].token_ids == out.token_ids  # the same seed, the same masked draws
    vocab = 49152
    allowed = _allowed(tiny_tok, so, out.token_ids, vocab)
    with torch.no_grad():
        logits = hf_model(tiny_tok)(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
    for j, (row, rrow, ok) in enumerate(zip(out.logprobs, raw.outputs[0].logprobs, allowed)):
        lp = np.full(vocab, -np.inf)
        for t, v in row.items():
            lp[t] = v.logprob
        assert np.isneginf(lp[~ok]).all(), f"row {j}: a disallowed token has mass"
        assert abs(np.exp(lp[ok]).sum() - 1.0) <= 1e-5, f"row {j}"
        assert ok[out.token_ids[j]]
        raw_row = torch.tensor([rrow[t].logprob for t in range(vocab)])
        bound = 2 * fp32_tol(logits[len(prompt) - 1 + j].abs().max())
        assert (raw_row - ref[j]).abs().max() <= bound, f"row {j}"


# Grammars whose text also stands in the prompt, so that prompt lookup has something to draft.
DRAFTABLE = [
    StructuredOutputsParams(regex=r"the cat sat on the (mat|hat)\. [a-z]{1,8}"),
    StructuredOutputsParams(choice=["dark blue red", "red green blue"]),
    GRAMMARS[2],
    StructuredOutputsParams(grammar='start: "maybe " NUMBER " yes no"\nNUMBER: /[0-9]{1,3}/'),
]


@pytest.mark.parametrize("mode", [True, "adaptive"], ids=["ngram", "adaptive"])
@pytest.mark.parametrize("so", DRAFTABLE, ids=["regex", "choice", "json", "lark"])
def test_seeded_output_is_identical_with_and_without_ngram(engines, tiny_tok, so, mode):
    """Drafts are cut to the grammar's valid prefix and verified under one mask per row (adaptive
    verification choosing which rows): the speculative engine emits exactly the plain engine's
    tokens and logprobs."""
    from transformers import AutoTokenizer

    # Text the grammars allow, twice, so prompt lookup finds continuations to draft.
    text = 'dark blue red green. maybe 12 yes no\n{"n":42}\nthe cat sat on the mat. '
    prompt = AutoTokenizer.from_pretrained(tiny_tok).encode(text * 2)
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=16, logprobs=2, structured_outputs=so)
              for s in range(16)]
    spec = engines[mode]
    before = spec.stats()
    plain = engines[False].generate([prompt] * 16, params, use_tqdm=False)
    fast = spec.generate([prompt] * 16, params, use_tqdm=False)
    for a, b in zip(plain, fast):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        for ra, rb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(ra) == list(rb)
            assert all(ra[t].logprob == rb[t].logprob or abs(ra[t].logprob - rb[t].logprob) < 1e-4 for t in ra)
    after = spec.stats()
    if mode == "adaptive":
        # Adaptive verification stops drafting where drafts keep failing (this random model's),
        # so only the engine's total is sure to have grown: constrained drafts went through it.
        assert after["adaptive"]["admitted_total"] > 0
    else:
        assert after["num_draft_tokens"] > before["num_draft_tokens"]  # drafts verified under the grammar


def test_choice_and_regex_end_with_eos_and_length_cuts_a_value(engines, tiny_tok):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tok)
    llm = engines[False]
    choices = ["red", "green", "blue", "dark blue"]
    outs = llm.generate([[1, 5, 6]] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=10,
                                                          structured_outputs={"choice": choices}) for s in range(6)],
                        use_tqdm=False)
    for o in outs:
        assert o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop"
        assert tok.decode(o.outputs[0].token_ids[:-1]) == o.outputs[0].text  # then EOS, nothing else
    cut = llm.generate([[1, 5, 6]], SamplingParams(temperature=0, max_tokens=3,
                                                   structured_outputs={"regex": "[a-z]{20}"}), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].text) < 20


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": "start: (\n"}, "structured_outputs.grammar"),
    ({"json": "{not json"}, "structured_outputs.json"),
])
def test_an_invalid_grammar_is_a_clear_error_and_queues_nothing(engines, so, field):
    llm = engines[False]
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        llm.generate([[1, 5]], SamplingParams(n=2, structured_outputs=so), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_n_children_each_follow_the_grammar(engines):
    out = engines[True].generate([[1, 7, 7, 7]], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=20,
                                                                structured_outputs={"json_object": True}),
                                 use_tqdm=False)[0]
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.text.lstrip().startswith("{")


@pytest.mark.slow
def test_smollm2_schemas_validate_and_speculation_changes_nothing():
    """200 seeded generations at temperature 0.8 over 8 schemas, half of them with ngram drafts:
    every finished output parses and validates; the speculative half equals the plain engine's."""
    import jsonschema

    schemas = [
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["color"], "additionalProperties": False},
        {"type": "object", "properties": {"city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}}, "required": ["name"], "additionalProperties": False}}, "required": ["city"], "additionalProperties": False},
        {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "maxLength": 8}]}}, "required": ["answer"], "additionalProperties": False},
        {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 30}}, "required": ["ok"], "additionalProperties": False},
        {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
        {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}, "label": {"type": "string", "maxLength": 10}}, "required": ["point", "label"], "additionalProperties": False},
    ]
    questions = ["Describe a person as JSON.", "Give some tags for a cooking blog.", "Pick a color.", "Describe a city.",
                 "Answer the question: how many legs does a spider have?", "Is the sky blue? Say why.",
                 "List a few small integers.", "Give a labelled 2D point."]
    plain = LLM(dtype="float32", quantization="gguf", num_kv_blocks=1024)
    spec = LLM(dtype="float32", quantization="gguf", num_kv_blocks=1024, speculative_config=SPEC)
    convs, params = [], []
    for i in range(200):
        k = i % 8
        convs.append([{"role": "user", "content": f"{questions[k]} Reply with JSON only."}])
        params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=96, structured_outputs={"json": schemas[k]}))
    outs = plain.chat(convs, params, use_tqdm=False)
    spec_outs = spec.chat(convs[100:], params[100:], use_tqdm=False)
    finished = 0
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schemas[i % 8])
            finished += 1
    assert finished >= 180, finished
    for a, b in zip(outs[100:], spec_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert spec.stats()["num_accepted_tokens"] > 0


def _exact_choice_distribution(tiny_tok: str, prompt: list[int], so: StructuredOutputsParams) -> dict[str, float]:
    """P(output text) at temperature 1 under the grammar: every token path, each step's HF row
    restricted to the grammar's allowed tokens and renormalized (paths below 1e-9 are dropped)."""
    import llguidance
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer

    from verispec.sample.grammar import _FORMATS, _grammar_text

    hf_tok = AutoTokenizer.from_pretrained(tiny_tok)
    model, vocab, eos = hf_model(tiny_tok), 49152, 2
    m = llguidance.LLMatcher(from_tokenizer(hf_tok, n_vocab=vocab, eos_token=[eos]),
                             llguidance.grammar_from(_FORMATS[so.kind], _grammar_text(so)))
    out: dict[str, float] = {}

    def visit(path: list[int], prob: float) -> None:
        ok = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab].astype(bool)
        with torch.no_grad():
            row = model(torch.tensor([prompt + path])).logits[0, -1].double()
        row[~torch.from_numpy(ok)] = -math.inf
        p = torch.softmax(row, -1)
        for t in np.flatnonzero(ok):
            q = prob * float(p[t])
            if t == eos:
                text = hf_tok.decode(path)
                out[text] = out.get(text, 0.0) + q
            elif q > 1e-9:
                assert m.consume_token(int(t))
                visit(path + [int(t)], q)
                m.rollback(1)

    visit([], 1.0)
    return out


@pytest.fixture(scope="module")
def choice_case(tiny_tok):
    from transformers import AutoTokenizer

    so = StructuredOutputsParams(choice=["dark blue", "light green", "deep red"])
    prompt = AutoTokenizer.from_pretrained(tiny_tok).encode("deep red, light green and dark blue; dark blue")
    exact = _exact_choice_distribution(tiny_tok, prompt, so)
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    return so, prompt, exact


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_sampled_strings_follow_the_grammar_restricted_distribution(engines, choice_case, spec):
    """Chi-square: over 2000 seeds, the strings a choice grammar yields follow the target restricted
    to the grammar and renormalized, step by step, with and without drafts (the prompt holds the
    choices, so prompt lookup drafts their second words)."""
    from test_verify import chi_square

    so, prompt, exact = choice_case
    n = 2000
    llm = engines[spec]
    drafts = llm.stats()["num_draft_tokens"]
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=12, structured_outputs=so)
                                       for s in range(n)], use_tqdm=False)
    counts: dict[str, int] = {}
    for o in outs:
        counts[o.outputs[0].text] = counts.get(o.outputs[0].text, 0) + 1
    assert set(counts) <= set(so.choice)
    stat, df = chi_square(counts, exact, n)
    assert stat < df + 10 * math.sqrt(2 * df), (stat, df, counts, exact)
    if spec:
        assert llm.stats()["num_draft_tokens"] > drafts


def test_packed_and_unpacked_masks_agree():
    """The CPU unpacks masks on the host (bool rows); CUDA ships the packed words and unpacks them
    on the device. Both ban exactly the tokens whose bit is 0."""
    from verispec.sample.grammar import apply_bitmask, bitmask_tensor

    g = np.random.default_rng(0)
    vocab = 100
    masks = [g.integers(0, 2**32, 4, dtype=np.uint32).astype(np.uint32).tobytes(), None]
    unpacked = bitmask_tensor(masks, vocab, torch.device("cpu"))
    words = np.full((2, 4), -1, dtype=np.int32)
    words[0] = np.frombuffer(masks[0], dtype=np.int32)
    a, b = torch.zeros(2, vocab), torch.zeros(2, vocab)
    apply_bitmask(a, unpacked)
    apply_bitmask(b, torch.from_numpy(words))
    assert torch.equal(a, b)
    expect = np.unpackbits(np.frombuffer(masks[0], dtype=np.uint8), bitorder="little")[:vocab].astype(bool)
    assert torch.equal(torch.isneginf(a[0]), torch.from_numpy(~expect)) and not torch.isinf(a[1]).any()
