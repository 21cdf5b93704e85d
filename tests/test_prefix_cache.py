"""Automatic prefix caching (core/prefix_cache.py): hits change what is computed, never a value.

The reference is always the same engine with the cache off: outputs and every logprob (sampled
and prompt) must be equal, and afterwards every block must be free (cached blocks with no user
count as free). The tiny model runs the exact tier with 16-token blocks, where the CPU attention
kernel computes a position alike whatever chunk it is in.
"""

from __future__ import annotations

import itertools

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SMOLLM2_LOGPROB_TOL, TINY_VOCAB, examples, random_prompts
from verispec import LLM, SamplingParams
from verispec.core.kv_cache import BlockPool
from verispec.core.prefix_cache import PrefixCache, PromptRowCache, chain_hash
from verispec.core.request import Request
from verispec.outputs import LogprobsLists
from verispec.sample.noise import RequestNoise

# Two fp32 runs of one row that differ in batch shape: the logprobs' bound (conftest).
TOL = SMOLLM2_LOGPROB_TOL
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def _engine(path: str, enable: bool, blocks: int = 10, **kw):
    return LLM(path, dtype="float32", block_size=16, num_kv_blocks=blocks, max_num_batched_tokens=48,
               max_num_seqs=4, enable_prefix_caching=enable, **kw).engine


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return {enable: _engine(tiny_llama, enable) for enable in (True, False)}


def assert_pool_clean(engine) -> None:
    pool = engine.pool
    assert not pool.tables, f"blocks still held by {sorted(pool.tables)}"
    assert pool.ref_count == [0] * pool.num_blocks
    assert pool.num_free_blocks == pool.num_blocks
    assert len(pool._free) + len(pool._evictable) == pool.num_blocks
    assert set(pool.cached.values()) == set(pool._evictable)  # a cached block with no user is evictable


def _same_value(a: float, b: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= TOL


def assert_same_rows(ours, ref, what: str) -> None:
    assert (ours is None) == (ref is None), what
    if ours is None:
        return
    assert len(ours) == len(ref), what
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert (a is None) == (b is None), f"{what} row {i}"
        if a is None:
            continue
        assert list(a) == list(b), f"{what} row {i}: ids {list(a)} vs {list(b)}"
        for t in a:
            assert a[t].rank == b[t].rank, f"{what} row {i} token {t}"
            assert _same_value(a[t].logprob, b[t].logprob), f"{what} row {i} token {t}: {a[t].logprob} vs {b[t].logprob}"


def assert_same_output(ours, ref) -> None:
    rid = ours.request_id
    assert ours.error is None and ref.error is None
    assert_same_rows(ours.prompt_logprobs, ref.prompt_logprobs, f"{rid} prompt logprobs")
    assert len(ours.outputs) == len(ref.outputs)
    for a, b in zip(ours.outputs, ref.outputs):
        assert a.token_ids == b.token_ids, f"{rid}[{a.index}]"
        assert a.finish_reason == b.finish_reason
        assert_same_rows(a.logprobs, b.logprobs, f"{rid}[{a.index}] logprobs")


def run_script(engine, script) -> dict:
    """ops: ("add", rid, prompt, params) | ("step", n) | ("abort", rid); then runs to the end."""
    done = {}

    def step():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out

    for op in script:
        if op[0] == "add":
            engine.add_request(op[1], op[2], op[3])
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        else:
            engine.abort_request(op[1])
    while engine.has_unfinished_requests():
        step()
    return done


def compare_on_off(engines, script) -> dict:
    engines[True].reset_prefix_cache()
    on, off = run_script(engines[True], script), run_script(engines[False], script)
    aborted = {op[1] for op in script if op[0] == "abort"}
    for rid in off:
        if rid not in aborted:
            assert_same_output(on[rid], off[rid])
    assert_pool_clean(engines[True])
    assert_pool_clean(engines[False])
    return on


# ------------------------------------------------------------------ the property
@st.composite
def scripts(draw):
    stems = [draw(st.lists(st.integers(3, TINY_VOCAB - 1), min_size=24, max_size=64)) for _ in range(2)]
    script, rids = [], []
    for i in range(draw(st.integers(2, 14))):
        op = draw(st.sampled_from(["add", "add", "add", "step", "abort"]))
        if op == "abort" and rids:
            script.append(("abort", draw(st.sampled_from(rids))))
        elif op == "step":
            script.append(("step", draw(st.integers(1, 6))))
        else:
            stem = draw(st.sampled_from(stems))
            cut = draw(st.integers(len(stem) // 2, len(stem)))
            prompt = stem[:cut] + draw(st.lists(st.integers(3, TINY_VOCAB - 1), max_size=12))
            greedy = draw(st.booleans())
            params = SamplingParams(
                temperature=0.0 if greedy else 0.9, seed=None if greedy else draw(st.integers(0, 99)),
                top_k=draw(st.sampled_from([0, 0, 5])), max_tokens=draw(st.integers(1, 16)), ignore_eos=True,
                n=draw(st.sampled_from([1, 1, 2])), logprobs=draw(st.sampled_from([None, 0, 2])),
                prompt_logprobs=draw(st.sampled_from([None, 1, 1, 3])),
                logprobs_mode=draw(st.sampled_from(MODES[:1] * 3 + MODES[1:])),
            )
            rid = f"r{i}"
            rids.append(rid)
            script.append(("add", rid, prompt, params))
    return script


@settings(max_examples=examples(100), suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(script=scripts())
def test_outputs_and_logprobs_equal_a_cache_off_run(engines, script):
    """Overlapping prompts, prompt-logprob requests in every mode, n = 2, aborts, and a 10-block
    pool that evicts and preempts: every output and logprob equals the cache-off engine's."""
    compare_on_off(engines, script)


def test_the_property_sees_hits_rows_evictions_and_preemptions(engines):
    """The script the property is made of, sized so that each mechanism certainly happens."""
    stem = random_prompts(1, 60, 60, seed=7)[0]
    scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    script = [("add", "a", stem + [5], scored), ("step", 3), ("add", "b", stem + [6, 7], scored),
              ("add", "c", stem[:40] + [9] * 30, SamplingParams(temperature=0, max_tokens=8)),
              ("add", "d", stem + [8], SamplingParams(temperature=0.9, seed=3, max_tokens=40, n=2, ignore_eos=True))]
    pc = engines[True].prefix_cache
    before = (pc.num_hits, pc.num_prompt_rows_hit, engines[True].scheduler.num_preemptions)
    compare_on_off(engines, script)
    hits, rows, preemptions = (pc.num_hits - before[0], pc.num_prompt_rows_hit - before[1],
                               engines[True].scheduler.num_preemptions - before[2])
    assert hits >= 3 * 48, hits  # b, both children of d, and preempted requests again
    assert rows >= 48, rows  # b's rows over a's three full blocks came from the cache
    assert preemptions > 0


# ------------------------------------------------------------------ rows
def test_prompt_rows_are_read_only_when_they_answer_the_request(tiny_llama):
    """Rows cached for (raw, k=3) answer raw k <= 3 with no computation; a processed mode or a
    wider k reads the KV only up to its first scored position: here, nothing."""
    eng = _engine(tiny_llama, True, blocks=32, max_logprobs=-1)
    ref = _engine(tiny_llama, False, blocks=32, max_logprobs=-1)
    prompt = random_prompts(1, 70, 70, seed=3)[0]
    pc = eng.prefix_cache

    def both(params, expect_hit: int, expect_rows: int):
        h, r = pc.num_hits, pc.num_prompt_rows_hit
        out = run_script(eng, [("add", f"x{h}-{r}", prompt, params)])
        want = run_script(ref, [("add", "y", prompt, params)])
        assert_same_output(next(iter(out.values())), want["y"])
        assert (pc.num_hits - h, pc.num_prompt_rows_hit - r) == (expect_hit, expect_rows)

    both(SamplingParams(max_tokens=1, prompt_logprobs=3), 0, 0)
    both(SamplingParams(max_tokens=1, prompt_logprobs=1), 64, 64)  # 4 full blocks below token 69
    both(SamplingParams(max_tokens=1, prompt_logprobs=-1), 0, 0)  # every token: not cached
    both(SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs_mode="processed_logprobs", temperature=0.5), 0, 0)
    both(SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs_mode="processed_logprobs", temperature=0.5), 64, 64)
    both(SamplingParams(max_tokens=1), 64, 0)  # no prompt logprobs: the KV alone


def test_rows_wait_for_a_whole_block_and_key_on_the_next_token():
    """Rows of block b are those computed at its positions; the last one predicts the token after
    it, so the same block followed by another token has other rows."""
    pool = BlockPool(8, 4)
    pc = PrefixCache(pool, "m", rows_budget_bytes=1 << 20)
    req = _request([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], prompt_logprobs=1)
    assert pool.allocate(req.request_id, 10)
    req.num_computed_tokens = 10
    pc.cache_computed(req)
    assert pool.num_cached_blocks == 2
    pc.cache_prompt_rows(req, 0, _rows(range(0, 6)))  # positions 0..5: block 0 whole, block 1 not
    assert len(pc.rows) == 1 and pc._progress[req.request_id].pending_rows[0] == 4
    pc.cache_prompt_rows(req, 6, _rows(range(6, 9)))  # up to position 8: block 1 (4..7) whole
    assert len(pc.rows) == 2
    hashes = pc.block_hashes(req)
    key = ("raw_logprobs",)
    got = pc.rows.get(hashes[1], key, 18, 1)
    assert got is not None and list(got.selected_token_ranks) == [4, 5, 6, 7]
    assert pc.rows.get(hashes[1], key, 99, 1) is None  # another next token
    assert pc.rows.get(hashes[1], key, 18, 2) is None  # wider than cached


def test_row_memory_stays_within_its_budget_and_leaves_with_the_block():
    one = _rows(range(4))
    size = one.logprob_token_ids.astype(np.int32).nbytes + one.logprobs.nbytes + 4 * 4
    cache = PromptRowCache(3 * size)
    for i in range(5):
        cache.put(bytes([i]), ("raw_logprobs",), 0, 1, one)
        assert cache.num_bytes <= 3 * size
    assert len(cache) == 3 and cache.get(bytes([0]), ("raw_logprobs",), 0, 1) is None  # oldest out
    cache.drop(bytes([4]))
    assert len(cache) == 2 and cache.num_bytes == 2 * size
    # Evicting a block's KV drops its rows.
    pool = BlockPool(2, 4)
    pc = PrefixCache(pool, "m", rows_budget_bytes=1 << 20)
    req = _request([5, 6, 7, 8, 9], prompt_logprobs=1)
    assert pool.allocate(req.request_id, 5)
    req.num_computed_tokens = 4
    pc.cache_computed(req)
    pc.cache_prompt_rows(req, 0, _rows(range(4)))
    assert len(pc.rows) == 1
    pool.free(req.request_id)
    assert pool.allocate("other", 4) and len(pc.rows) == 1  # the plain block goes first
    assert pool.allocate("other", 8)  # then the cached one is evicted
    assert len(pc.rows) == 0 and pc.rows.num_bytes == 0


# ------------------------------------------------------------------ hashes and salts
def test_hash_chains_cover_every_earlier_token_the_salt_and_the_engine():
    pool = BlockPool(8, 4)
    pc = PrefixCache(pool, "model-a")
    a = pc.block_hashes(_request(list(range(3, 15))))
    b = pc.block_hashes(_request([3, 4, 5, 99] + list(range(7, 15))))
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))  # one token in block 0 changes every hash
    salted = pc.block_hashes(_request(list(range(3, 15)), cache_salt="tenant-1"))
    assert all(x != y for x, y in zip(a, salted))
    other = PrefixCache(BlockPool(8, 4), "model-b").block_hashes(_request(list(range(3, 15))))
    assert all(x != y for x, y in zip(a, other))
    assert a[1] == chain_hash(a[0], list(range(7, 11)))  # SHA-256 over the parent and the ids


def test_salted_requests_never_share_a_block(tiny_llama):
    eng = _engine(tiny_llama, True, blocks=32)
    prompt = random_prompts(1, 70, 70, seed=5)[0]
    tables = {}

    def run(rid, salt):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=20, cache_salt=salt, temperature=0))
        while eng.has_unfinished_requests():
            tables[rid] = list(eng.pool.table(rid)) or tables.get(rid, [])
            eng.step()

    run("a", "alice")
    hits = eng.prefix_cache.num_hits
    run("b", "bob")
    assert eng.prefix_cache.num_hits == hits and not set(tables["a"]) & set(tables["b"])
    run("c", "alice")  # the same tenant hits its own prefix
    assert eng.prefix_cache.num_hits - hits == 64 and tables["c"][:4] == tables["a"][:4]
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


# ------------------------------------------------------------------ n > 1, speculation, reset
def test_n_children_share_the_prompt_blocks(engines):
    prompt = random_prompts(1, 70, 70, seed=11)[0]
    pc = engines[True].prefix_cache
    before = pc.num_hits
    out = compare_on_off(engines, [("add", "n", prompt, SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=6))])
    assert pc.num_hits - before == 2 * 64  # the two later children hit the first one's 4 blocks
    assert len({tuple(c.token_ids) for c in out["n"].outputs}) > 1  # they still sample apart


SPEC_CONFIGS = [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2},
    {"method": "draft_model", "num_speculative_tokens": 3},  # the model drafts for itself: its own KV cache
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive_verification": True,
     "cost_table": [[1, 0.01], [16, 0.012], [64, 0.03]]},
]


@pytest.mark.parametrize("spec", SPEC_CONFIGS, ids=["ngram", "layer_skip", "draft_model", "adaptive"])
def test_speculative_decoding_with_hits(tiny_llama, spec):
    """Rollback after rejected drafts never frees or corrupts a shared block, and a draft model's
    own cache is valid on a hit: greedy output and logprobs equal the cache-off run, and the pool
    ends clean."""
    if spec["method"] == "draft_model":
        spec = {**spec, "model": tiny_llama}
    engines = {e: _engine(tiny_llama, e, blocks=24, speculative_config=spec) for e in (True, False)}
    stem = random_prompts(1, 50, 50, seed=2)[0]
    loop = stem[:12] * 3
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, prompt_logprobs=1)
    script = [("add", "a", loop + [7], params), ("step", 4), ("add", "b", loop + [8, 9], params),
              ("add", "c", loop + [7], SamplingParams(temperature=0, max_tokens=24, logprobs=2)),
              ("step", 2), ("add", "d", loop + [7, 1, 2, 3], params)]
    compare_on_off(engines, script)
    m = engines[True].spec_metrics
    assert engines[True].prefix_cache.num_hits > 0
    if spec["method"] == "draft_model":
        # A model drafting for itself is right unless its cache is stale: the hit blocks' draft KV holds.
        assert m.num_accepted_tokens >= 0.95 * m.num_draft_tokens > 0, (m.num_accepted_tokens, m.num_draft_tokens)
    else:
        assert m.num_draft_tokens > m.num_accepted_tokens  # drafts were rejected: rollbacks happened


def test_reset_forgets_every_prefix_and_what_running_requests_compute_from_it(tiny_llama):
    eng = _engine(tiny_llama, True, blocks=32)
    prompt = random_prompts(1, 40, 40, seed=9)[0]
    run_script(eng, [("add", "a", prompt, SamplingParams(max_tokens=2))])
    assert eng.pool.num_cached_blocks == 2
    eng.add_request("b", prompt, SamplingParams(max_tokens=30, temperature=0))
    eng.step()
    eng.reset_prefix_cache()
    assert eng.pool.num_cached_blocks == 0 and eng.pool.tables["b"]
    hits = eng.prefix_cache.num_hits
    run_script(eng, [("add", "c", prompt, SamplingParams(max_tokens=2))])
    # b's KV predates the reset (say, a weight update): nothing it computes is cached. c's is.
    assert eng.prefix_cache.num_hits == hits and eng.pool.num_cached_blocks == 2
    run_script(eng, [("add", "d", prompt, SamplingParams(max_tokens=2))])
    assert eng.prefix_cache.num_hits == hits + 32
    assert_pool_clean(eng)
    assert eng.stats()["prefix_cache_hit_rate"] == pytest.approx(eng.prefix_cache.num_hits / eng.prefix_cache.num_queries)


def test_cache_off_finds_nothing(engines):
    run_script(engines[False], [("add", "a", list(range(3, 60)), SamplingParams(max_tokens=1))] * 1)
    run_script(engines[False], [("add", "b", list(range(3, 60)), SamplingParams(max_tokens=1))])
    stats = engines[False].stats()
    assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0 and stats["prefix_cache_blocks"] == 0


# ------------------------------------------------------------------ helpers
_ids = itertools.count()


def _request(ids: list[int], prompt_logprobs: int | None = None, cache_salt: str | None = None) -> Request:
    params = SamplingParams(prompt_logprobs=prompt_logprobs, cache_salt=cache_salt)
    return Request(f"r{next(_ids)}", None, ids, params, params.logprobs_mode or _raw(), RequestNoise(0), frozenset(), 4,
                   scores_prompt=prompt_logprobs is not None)


def _raw():
    from verispec.config import LogprobsMode

    return LogprobsMode.RAW_LOGPROBS


def _rows(positions) -> LogprobsLists:
    """Rows marked by their position (in the rank column), to see which ones the cache keeps."""
    pos = list(positions)
    n = len(pos)
    return LogprobsLists(np.zeros((n, 2), np.int64), np.zeros((n, 2), np.float32), np.array(pos, np.int64))
