"""The OpenAI-compatible server, end to end: a real `verispec serve` subprocess on a free port, driven by
the official `openai` client, `requests` and `curl`, checked against the in-process `LLM`.

The server runs with the same engine options as the `smollm2_llm` fixture, so a request run alone
gives the same logprobs on both sides (to float rounding of the CPU kernels). Structured output
over HTTP: test_server_structured.py; clients that leave mid-request: test_hostile.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
import torch

from conftest import SMOLLM2_LOGPROB_TOL
from server_utils import ServerProcess, sse_events
from verispec import SamplingParams
from verispec.models.cpu_kernels import kernels_wanted

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
SAME_ENGINE = ("--dtype", "float32", "--max-num-batched-tokens", "64", "--num-kv-blocks", "256")
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*SAME_ENGINE, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_server():
    """Speculation on (adaptive verification), no API key. The cost table is given, with
    verification nearly free: a table profiled at start-up on two busy cores (the suite under
    pytest-xdist) can say drafts never pay, and then no draft is verified. Profiling has its own
    tests (test_adaptive.py)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True,
            "cost_table": [[1, 0.02], [16, 0.021], [64, 0.03]]}
    srv = ServerProcess("--dtype", "float32", "--speculative-config", json.dumps(spec))
    yield srv
    srv.stop()


def _assert_same_entry(http_value: float, engine_value: float) -> None:
    # Usually bit-identical; two processes running the same matmuls have been seen to differ by
    # 6e-5 (CPU kernel reduction order), so the fp32 bound for SmolLM2's logprobs applies.
    assert abs(http_value - engine_value) <= SMOLLM2_LOGPROB_TOL, (http_value, engine_value)


# ------------------------------------------------------------------------------------------ chat
def test_chat_logprobs_equal_in_process(server, smollm2_llm):
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5,
    )
    ref = smollm2_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12, logprobs=5), use_tqdm=False)[0]
    ref_c = ref.outputs[0]
    choice = chat.choices[0]
    assert choice.message.content == ref_c.text
    assert choice.finish_reason == ref_c.finish_reason
    content = choice.logprobs.content
    assert len(content) == len(ref_c.token_ids)
    for entry, tok, ref_entry in zip(content, ref_c.token_ids, ref_c.logprobs):
        _assert_same_entry(entry.logprob, ref_entry[tok].logprob)
        assert entry.token == ref_entry[tok].decoded_token
        assert bytes(entry.bytes) == entry.token.encode()
        assert len(entry.top_logprobs) == 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        top_ref = sorted((lp for lp in ref_entry.values() if lp.rank is not None and lp.rank <= 5),
                         key=lambda lp: lp.rank)
        assert [t.token for t in entry.top_logprobs] == [lp.decoded_token for lp in top_ref]
        for value, lp in zip(values, top_ref):
            _assert_same_entry(value, lp.logprob)
        if ref_entry[tok].rank == 1:  # greedy: the chosen token is the top entry, same float
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == entry.logprob
    assert chat.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chat.usage.completion_tokens == len(ref_c.token_ids)


def test_chat_streaming_equals_plain(server):
    client = server.openai()
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert text == plain.choices[0].message.content
    # The second request may hit the first one's cached prefix and compute a shorter chunk: equal
    # within fp32 rounding (the dense fp32 matmuls round a row by the chunk's row count).
    assert [e.token for e in streamed] == [e.token for e in plain.choices[0].logprobs.content]
    for ours, ref in zip(streamed, plain.choices[0].logprobs.content):
        _assert_same_entry(ours.logprob, ref.logprob)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_n2_seeded_equals_in_process(server, smollm2_llm):
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, temperature=1.0, n=2, seed=11, logprobs=True,
    )
    ref = smollm2_llm.chat(QUESTION, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=11, logprobs=0),
                           use_tqdm=False)[0]
    assert [c.index for c in chat.choices] == [0, 1]
    for choice, ref_c in zip(chat.choices, ref.outputs):
        assert choice.message.content == ref_c.text
        for entry, tok, ref_entry in zip(choice.logprobs.content, ref_c.token_ids, ref_c.logprobs):
            _assert_same_entry(entry.logprob, ref_entry[tok].logprob)


# ------------------------------------------------------------------------------------ completions
def _lm_eval_prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    texts = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of",
             "def add(a, b):\n    return", "One, two, three, four,"]
    return [tok.encode(t) for t in texts]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request(server, smollm2_llm, max_tokens):
    """Exactly what lm-eval's local-completions sends: 4 token-id prompts, echo, logprobs=1."""
    prompts = _lm_eval_prompts(smollm2_llm)
    resp = server.openai().completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1,
                                              max_tokens=max_tokens, temperature=0, seed=1234)
    refs = smollm2_llm.generate([list(p) for p in prompts],
                                SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
                                use_tqdm=False)
    assert len(resp.choices) == 4
    for choice, prompt, ref in zip(sorted(resp.choices, key=lambda c: c.index), prompts, refs):
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(prompt)):
            ref_entry = ref.prompt_logprobs[i]
            _assert_same_entry(lp.token_logprobs[i], ref_entry[prompt[i]].logprob)
            # lm-eval's greediness test: token_logprob == max(top_logprobs.values()) iff rank 1
            is_greedy = lp.token_logprobs[i] == max(lp.top_logprobs[i].values())
            assert is_greedy == (ref_entry[prompt[i]].rank == 1)
            assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        if max_tokens:
            _assert_same_entry(lp.token_logprobs[-1], ref.outputs[0].logprobs[0][ref.outputs[0].token_ids[0]].logprob)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert choice.text.startswith(smollm2_llm.get_tokenizer().decode(prompt))
        assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == sum(map(len, prompts))
    assert resp.usage.completion_tokens == 4 * max_tokens


def test_completion_logprobs_modes_and_prompt_logprobs_equal_in_process(server, smollm2_llm):
    body = {"model": MODEL, "prompt": "A list of fruits: apple, banana,", "max_tokens": 8, "temperature": 0.8,
            "top_k": 20, "seed": 7, "logprobs": 3, "prompt_logprobs": 2, "logprobs_mode": "processed_logprobs"}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = smollm2_llm.generate(body["prompt"], SamplingParams(
        max_tokens=8, temperature=0.8, top_k=20, seed=7, logprobs=3, prompt_logprobs=2,
        logprobs_mode="processed_logprobs"), use_tqdm=False)[0]
    ref_c = ref.outputs[0]
    assert choice["text"] == ref_c.text
    for value, tok, ref_entry in zip(choice["logprobs"]["token_logprobs"], ref_c.token_ids, ref_c.logprobs):
        _assert_same_entry(value, ref_entry[tok].logprob)
        assert math.isfinite(value)
    prompt_lp = choice["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(ref.prompt_token_ids)
    for http_entry, ref_entry in zip(prompt_lp[1:], ref.prompt_logprobs[1:]):
        # JSON has no -inf: a masked (top-k) prompt token is reported as -9999.0, as vLLM does
        got = {int(t): e["logprob"] for t, e in http_entry.items()}
        want = {t: lp.logprob if math.isfinite(lp.logprob) else -9999.0 for t, lp in ref_entry.items()}
        assert got.keys() == want.keys()
        for t in got:
            _assert_same_entry(got[t], want[t])
        assert {int(t): e["rank"] for t, e in http_entry.items()} == {t: lp.rank for t, lp in ref_entry.items()}


def test_stop_strings_plain_and_streaming(server, smollm2_llm):
    prompt = "Count: 1, 2, 3, 4,"
    ref = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    stop = ref.text[6:9]  # a stop string that the unconstrained greedy text reaches
    assert stop.strip()
    client = server.openai()
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == ref.text[: ref.text.index(stop)]
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                              stop=[stop], stream=True))
    text = "".join(c.choices[0].text for c in streamed)
    assert text == resp.choices[0].text
    assert all(stop not in c.choices[0].text for c in streamed)
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_streaming_echo_and_n(server):
    r = server.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 5, "n": 2, "temperature": 1.0,
                                        "seed": 3, "echo": True, "stream": True}, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    texts = {0: "", 1: ""}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    plain = server.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 5, "n": 2, "temperature": 1.0,
                                            "seed": 3, "echo": True}).json()
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert all(t.startswith("Hello there") for t in texts.values())


# ----------------------------------------------------------------------------------------- errors
ERROR_CASES = [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1, "logprobs_mode": "softmax"}, "logprobs_mode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 50}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi " * 9000}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, "model"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [99999999]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", ERROR_CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_invalid_input_is_400_naming_the_field(server, path, body, param):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in err["message"] or param in ("model", "prompt", "messages")
    assert err["type"] and err["code"] == 400


@pytest.mark.parametrize("raw", ['{"prompt": "hi",', "not json", '["a list"]', ""])
def test_malformed_json_is_400(server, raw):
    r = server.post("/v1/completions", raw)
    assert r.status_code == 400, r.text
    assert "error" in r.json() and r.json()["error"]["code"] == 400


def test_api_key_required_on_v1_only(server):
    no_key = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    wrong = requests.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert no_key.status_code == 401 and wrong.status_code == 401
    assert no_key.json()["error"]["code"] == 401
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert server.get("/v1/models").status_code == 200


# --------------------------------------------------------------------------- operational routes
def test_models_tokenize_detokenize_tokenizer_info(server, smollm2_llm):
    models = server.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    tok = smollm2_llm.get_tokenizer()
    r = server.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode("Hello world", add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert server.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    info = server.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template


def test_metrics_exposes_engine_and_latency(server):
    server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    m = server.metrics()
    for name in ("verispec:kv_cache_usage_perc", "verispec:num_requests_running", "verispec:num_preemptions_total",
                 "verispec:spec_decode_num_drafts_total", "verispec:spec_decode_num_accepted_tokens_total",
                 "verispec:time_to_first_token_seconds_count", "verispec:inter_token_latency_seconds_count",
                 "verispec:request_success_total", "verispec:generation_tokens_total"):
        assert name in m, name
    assert m["verispec:time_to_first_token_seconds_count"] >= 1
    assert m["verispec:kv_cache_blocks_total"] == 256
    # What the engine runs on, as labels (SAME_ENGINE: fp32, eager, on this process's capability).
    info = next(line for line in server.get("/metrics").text.splitlines() if line.startswith("verispec:runtime_info{"))
    capability = torch.backends.cpu.get_cpu_capability()
    assert 'tier="exact"' in info and f'cpu_capability="{capability}"' in info and 'step="eager"' in info
    assert info.endswith(" 1.0")
    assert f'kernels="verispec {capability} (packed ' in info if kernels_wanted() else 'kernels="off (' in info


def test_prefix_cache_over_http_salts_reset_and_metrics(server, smollm2_llm):
    """lm-eval's shape twice: the second time the shared context's KV and prompt rows come from the
    cache and every logprob is the same; another cache_salt hits nothing; a reset (API key
    required) forgets everything."""
    tok = smollm2_llm.get_tokenizer()
    context = tok.encode("Question: which of these is a fruit, and why would a botanist agree? " * 4 + "Answer:")
    prompts = [context + tok.encode(" " + choice) for choice in ("apple", "stone", "chair", "cloud")]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}

    def run(**extra):
        before = server.metrics()
        resp = server.post("/v1/completions", {**body, **extra}).json()
        after = server.metrics()
        delta = {k: after[f"verispec:prefix_cache_{k}_total"] - before[f"verispec:prefix_cache_{k}_total"]
                 for k in ("queries", "hits", "prompt_rows_hits")}
        return [c["logprobs"]["token_logprobs"] for c in sorted(resp["choices"], key=lambda c: c["index"])], delta

    # Whole 16-token blocks before each prompt's last token; the first request of a fresh salt
    # hits nothing, the three after it hit its blocks.
    hittable = [(len(p) - 1) // 16 * 16 for p in prompts]
    first, _ = run(cache_salt="t1")
    again, delta = run(cache_salt="t1")
    assert delta["hits"] == sum(hittable) and delta["prompt_rows_hits"] == sum(hittable), delta
    assert again == first  # the cached rows are the rows computed the first time
    _, other = run(cache_salt="t2")
    assert other["hits"] == sum(hittable[1:]), other
    assert 0 < server.metrics()["verispec:prefix_cache_hit_rate"] <= 1
    assert requests.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 401
    assert server.post("/reset_prefix_cache", {}).status_code == 200
    _, after_reset = run(cache_salt="t1")
    assert after_reset["hits"] == sum(hittable[1:]), after_reset
    bad = server.post("/v1/completions", {**body, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


# ------------------------------------------------------------------------ README, speculation, death
def _readme_block(lang: str, needle: str) -> str:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for block in re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S):
        if needle in block:
            return block
    raise AssertionError(f"README has no {lang} block with {needle!r}")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_example(spec_server):
    cmd = _readme_block("bash", "curl http://127.0.0.1:8000").replace("127.0.0.1:8000", f"127.0.0.1:{spec_server.port}")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120, check=True).stdout
    body = json.loads(out)
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def test_readme_openai_example(spec_server, capsys):
    code = _readme_block("python", "from openai import OpenAI").replace("127.0.0.1:8000", f"127.0.0.1:{spec_server.port}")
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "logprob" in printed and "None" in printed  # the echoed prompt's first logprob is null


def test_speculative_server_gives_the_same_greedy_text(server, spec_server):
    kw = dict(model=MODEL, messages=QUESTION + [{"role": "assistant", "content": "Paris."},
                                                {"role": "user", "content": "Repeat your answer twice."}],
              max_tokens=24, temperature=0)
    plain = server.openai().chat.completions.create(**kw).choices[0].message.content
    spec = spec_server.openai().chat.completions.create(**kw).choices[0].message.content
    assert spec == plain
    metrics = spec_server.metrics()
    assert metrics["verispec:spec_decode_num_drafts_total"] > 0
    assert metrics["verispec:spec_decode_adaptive_admitted_tokens_total"] == metrics[
        "verispec:spec_decode_num_draft_tokens_total"]


def test_dead_engine_core_gives_503():
    doomed = ServerProcess("--max-model-len", "256")  # its own server: the test kills its core
    try:
        pid = doomed.get("/health").json()["engine_core_pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while doomed.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert doomed.get("/health").status_code == 503
        r = doomed.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers.get("retry-after")
        assert r.json()["error"]["code"] == 503
        assert doomed.metrics()["verispec:engine_core_alive"] == 0
    finally:
        doomed.stop()
