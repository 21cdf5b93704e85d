"""Data parallelism (engine/dp_client.py): the router alone, the client's bookkeeping over stand-in
replicas, and `verispec serve --data-parallel-size 2` end to end on a tiny random model.

The tiny checkpoint gets a word-level tokenizer ("t0" .. "t511", one word per token id), so an
answer's text spells its token ids and two answers' texts are equal exactly when their tokens are.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import random_prompts
from server_utils import ServerProcess, sse_events
from verispec.config import EngineConfig
from verispec.engine.core_client import EngineDeadError
from verispec.engine.core_protocol import CompletionDelta, EngineStats, RequestDelta
from verispec.engine.dp_client import DPEngineClient, DPRouter, replica_config, sum_stats
from verispec.sampling_params import SamplingParams

BS = 4  # block size of the router unit tests


# ------------------------------------------------------------------------------------- router
def _prompt(*blocks: int, tail: int = 0) -> list[int]:
    """A prompt of full blocks, block b holding the token b four times, plus `tail` loose tokens."""
    return [b for b in blocks for _ in range(BS)] + [500] * tail


def test_shortest_queue_and_ties_alternate():
    router = DPRouter(3, BS)
    for rank, n in enumerate([3, 1, 2]):
        router.replicas[rank].in_flight = n
    assert router.route([7, 8]) == 1
    fresh = DPRouter(2, BS)
    ranks = [fresh.route([9]) for _ in range(10)]  # a burst: nothing finishes in between
    assert ranks == [0, 1] * 5
    for rank in ranks:
        fresh.finish(rank)
    # Every queue empty again: the tie goes to the replica that served fewer requests.
    fresh.replicas[0].routed += 1
    assert fresh.route([9]) == 1


def test_block_hashes_chain_full_blocks_only():
    router = DPRouter(1, BS)
    a, b = router.block_hashes(_prompt(1, 2, tail=3)), router.block_hashes(_prompt(1, 3))
    assert len(a) == 2 and len(b) == 2
    assert a[0] == b[0] and a[1] != b[1]  # the second block chains the first: same start, then apart
    assert router.block_hashes([1] * (BS - 1)) == []
    assert DPRouter(1, BS, prefix_aware=False).block_hashes(_prompt(1, 2)) == []


def test_prefix_preference_longest_cached_prefix():
    router = DPRouter(3, BS)
    router.assign(0, router.block_hashes(_prompt(1)))
    router.assign(1, router.block_hashes(_prompt(1, 2, 3)))
    router.replicas[1].in_flight += 1  # r1: 2 in flight, r0: 1, r2: 0 (shortest)
    assert router.choose(router.block_hashes(_prompt(1, 2, 3, 4))) == (1, 3)
    assert router.choose(router.block_hashes(_prompt(1, 9))) == (0, 1)  # r0 and r1 hold 1 block: shorter queue
    assert router.choose(router.block_hashes(_prompt(5, 2, 3))) == (2, 0)  # a different first block: no match
    assert router.choose(router.block_hashes([1] * (BS - 1))) == (2, 0)  # under one block: queue only
    assert router.route(_prompt(1, 2, 3, 4)) == 1 and router.replicas[1].prefix_hits == 1


def test_slack_lets_the_shortest_queue_win():
    router = DPRouter(2, BS)
    hashes = router.block_hashes(_prompt(1, 2))
    router.assign(0, hashes)
    router.replicas[0].in_flight = 3  # r1: 0 in flight; 3 more is past the slack, max(2, 0)
    assert router.choose(hashes) == (1, 0)
    router.replicas[0].in_flight = 2  # 2 more: within the slack
    assert router.choose(hashes) == (0, 2)
    # The slack grows with the queues: 25% of the shortest.
    router.replicas[1].in_flight = 20
    router.replicas[0].in_flight = 25
    assert router.choose(hashes)[0] == 0
    router.replicas[0].in_flight = 26
    assert router.choose(hashes)[0] == 1
    # Once spilled, the prefix is remembered on both replicas: then the shorter queue of the two.
    router.assign(1, hashes)
    assert router.choose(hashes) == (1, 2)


def test_cache_salt_is_the_root_of_the_chain():
    router = DPRouter(2, BS)
    p = _prompt(1, 2)
    router.assign(0, router.block_hashes(p, "tenant-a"))
    router.replicas[0].in_flight = 0
    router.replicas[1].routed = -1  # r1 is the tie-break's pick: only a remembered prefix moves a request to r0
    assert router.choose(router.block_hashes(p, "tenant-a")) == (0, 2)
    assert router.choose(router.block_hashes(p, "tenant-b")) == (1, 0)
    assert router.choose(router.block_hashes(p)) == (1, 0)
    router.assign(1, router.block_hashes(p))
    assert router.cached_blocks(0, router.block_hashes(p)) == 0  # unsalted never matches a salted prompt


def test_dead_replicas_are_skipped_and_reset_forgets():
    router = DPRouter(3, BS)
    p = _prompt(1, 2)
    router.assign(0, router.block_hashes(p))
    router.mark_dead(0)
    router.replicas[2].in_flight = 5
    assert router.route(p) == 1  # r0 held the prefix and had the shortest queue, but it is gone
    assert router.route(p) == 1  # r1 now holds it and wins over r2's longer queue
    router.reset_prefix_memory()
    assert all(not load.blocks for load in router.replicas)
    router.mark_dead(1)
    router.mark_dead(2)
    assert router.route(p) is None


def test_memory_is_bounded_and_evicts_tails_first():
    router = DPRouter(1, BS, max_blocks_per_replica=3)
    router.assign(0, router.block_hashes(_prompt(1, 2, 3)))
    router.assign(0, router.block_hashes(_prompt(4, 5)))
    assert len(router.replicas[0].blocks) == 3
    # The newest prompt is whole; of the older one only its root is left.
    assert router.cached_blocks(0, router.block_hashes(_prompt(4, 5))) == 2
    assert router.cached_blocks(0, router.block_hashes(_prompt(1, 2, 3))) == 1


def test_stats_sum_counters_over_all_and_gauges_over_live():
    a = EngineStats(num_running=2, kv_blocks_total=10, kv_blocks_free=4, num_steps=5, prefix_cache_hits=3,
                    accepted_per_position=[1, 2])
    b = EngineStats(num_running=7, kv_blocks_total=10, kv_blocks_free=1, num_steps=6, prefix_cache_hits=1,
                    accepted_per_position=[4, 0, 9])
    total = sum_stats([a, b], [True, False])
    assert (total.num_running, total.kv_blocks_total, total.kv_blocks_free) == (2, 10, 4)
    assert (total.num_steps, total.prefix_cache_hits) == (11, 4)
    assert total.accepted_per_position == [5, 2, 9]


def test_replica_config_shares_the_cpus_and_splits_seeds(monkeypatch):
    import verispec.engine.dp_client as dp

    monkeypatch.setattr(dp, "_cpu_count", lambda: 2)
    config = EngineConfig(seed=7)
    assert replica_config(config, 0, 1) is config  # one replica: the config as given
    configs = [replica_config(config, rank, 2) for rank in range(2)]
    assert [c.num_threads for c in configs] == [1, 1] and config.num_threads is None
    assert configs[0].seed == 7 and configs[1].seed != 7
    assert replica_config(config, 0, 4).num_threads == 1  # never below one thread
    assert replica_config(EngineConfig(num_threads=3), 1, 2).num_threads == 3  # the user's choice stands


def test_cli_refuses_a_data_parallel_size_below_one(capsys):
    from verispec.entrypoints.cli import main

    assert main(["serve", "--data-parallel-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "--data-parallel-size must be an integer >= 1; got 0" in err and "Traceback" not in err


# ------------------------------------------------------------------- client over stand-in cores
def test_client_bookkeeping_over_stand_in_replicas(monkeypatch):
    """Routing, in-flight counts, aborts and a dead replica, with each replica's `generate`
    replaced by a stand-in that streams until the test releases it."""
    client = DPEngineClient(EngineConfig(), 2)
    aborted: list[tuple[int, list[str]]] = []

    def fake(rank):
        async def generate(rid, ids, params, group=None):  # group: the client request, for fair sharing
            yield RequestDelta(rid, [CompletionDelta(0, [rank], "")], False)
            if client.replicas[rank].dead:
                raise EngineDeadError("gone")
            await gates[rid].wait()
            if client.replicas[rank].dead:
                raise EngineDeadError("gone")
            yield RequestDelta(rid, [CompletionDelta(0, [rank], "")], True)
        return generate

    gates: dict[str, asyncio.Event] = {}
    for rank, replica in enumerate(client.replicas):
        monkeypatch.setattr(replica, "generate", fake(rank))
        monkeypatch.setattr(replica, "abort", lambda ids, rank=rank: aborted.append((rank, list(ids))))
    params = SamplingParams(max_tokens=2)

    async def run(rid):
        out = []
        try:
            async for delta in client.generate(rid, [1, 2, 3], params):
                out.append(delta.completions[0].token_ids[0])
        except EngineDeadError:
            out.append("503")
        return out

    async def scenario():
        for rid in "abcd":
            gates[rid] = asyncio.Event()
        tasks = {rid: asyncio.create_task(run(rid)) for rid in "abcd"}
        await asyncio.sleep(0.01)
        assert [load.in_flight for load in client.router.replicas] == [2, 2]
        client.abort(["a", "b", "nobody"])
        assert aborted == [(0, ["a"]), (1, ["b"])]
        with pytest.raises(ValueError, match="already running"):
            await client.generate("a", [1], params).__anext__()
        client.replicas[1].dead = True  # the watchdog's verdict
        for rid in "abcd":
            gates[rid].set()
        results = {rid: await task for rid, task in tasks.items()}
        assert [load.in_flight for load in client.router.replicas] == [0, 0]
        assert not client.dead and client.replica_info()[1].alive is False
        gates["e"] = asyncio.Event()
        gates["e"].set()
        results["e"] = await run("e")  # the survivor takes new requests
        client.replicas[0].dead = True
        with pytest.raises(EngineDeadError):
            await client.generate("f", [1], params).__anext__()
        assert client.dead
        return results

    results = asyncio.run(scenario())
    assert results == {"a": [0, 0], "b": [1, "503"], "c": [0, 0], "d": [1, "503"], "e": [0, 0]}
    asyncio.run(client.shutdown())


# ---------------------------------------------------------------------------------- end to end
def _serve(model: str, *args: str) -> ServerProcess:
    return ServerProcess("--model", model, "--enforce-eager", "--data-parallel-size", "2", *args)


def _replicas(srv: ServerProcess) -> list[dict]:
    return srv.get("/health").json()["replicas"]


def _stream(srv: ServerProcess, body: dict) -> list[dict]:
    with requests.post(srv.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        return sse_events(r)


def test_64_streams_balanced_and_equal_to_in_process(tiny_with_tokenizer):
    from verispec import LLM

    # Half the prompts share one of four 32-token (two-block) prefixes, half are unrelated. Long
    # enough answers that all 64 are routed before the first finishes: the split then shows the
    # rule (queues, ties, the prefix slack), not which core the machine happened to run faster.
    shared = random_prompts(4, 32, 32, seed=1)
    tails = random_prompts(32, 8, 8, seed=2)
    prompts = [shared[i % 4] + tails[i] for i in range(32)] + random_prompts(32, 20, 40, seed=3)
    body = {"max_tokens": 128, "temperature": 0, "ignore_eos": True}
    srv = _serve(tiny_with_tokenizer)
    try:
        with ThreadPoolExecutor(64) as pool:
            streams = list(pool.map(lambda p: _stream(srv, {**body, "prompt": p}), prompts))
        replicas = _replicas(srv)
        split = [r["num_requests_routed"] for r in replicas]
        print(f"\n64-stream split over 2 replicas: {split}; prefix hits {[r['num_prefix_hits'] for r in replicas]}")
        assert sum(split) == 64 and min(split) >= 0.4 * 64, split
        assert all(r["alive"] and r["num_requests_in_flight"] == 0 for r in replicas)
        idle = srv.wait_idle()
        assert idle["verispec:kv_cache_blocks_free"] == idle["verispec:kv_cache_blocks_total"] > 0
        assert idle["verispec:engine_core_alive"] == 1
        # Each replica sends its own stats; the server sums them.
        assert idle["verispec:engine_steps_total"] >= 2 * 128

        texts = ["".join(e["choices"][0]["text"] for e in events) for events in streams]
        assert all(events[-1]["choices"][0]["finish_reason"] == "length" for events in streams)
        llm = LLM(tiny_with_tokenizer, enforce_eager=True)
        ref = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**body), use_tqdm=False)
        assert texts == [r.outputs[0].text for r in ref]
        assert [t.split() for t in texts] == [[f"t{i}" for i in r.outputs[0].token_ids] for r in ref]

        # A repeat of a routed prompt goes where its prefix is remembered; a reset forgets it.
        hits = sum(r["num_prefix_hits"] for r in _replicas(srv))
        assert srv.post("/v1/completions", {**body, "prompt": prompts[0]}).status_code == 200
        assert sum(r["num_prefix_hits"] for r in _replicas(srv)) == hits + 1
        assert srv.post("/reset_prefix_cache", {}).status_code == 200
        cached = srv.metrics()["verispec:prefix_cache_hits_total"]
        assert srv.post("/v1/completions", {**body, "prompt": prompts[0]}).status_code == 200
        assert sum(r["num_prefix_hits"] for r in _replicas(srv)) == hits + 1
        assert srv.metrics()["verispec:prefix_cache_hits_total"] == cached
    finally:
        srv.stop()


def test_a_dead_replica_fails_its_requests_and_the_other_serves(tiny_with_tokenizer):
    srv = _serve(tiny_with_tokenizer, "--max-model-len", "2048")
    try:
        pids = [r["engine_core_pid"] for r in _replicas(srv)]
        # Prompts under one block: routing is by queue alone, so with nothing finishing the
        # requests alternate, 0 1 0 1 ...: requests 0, 2, 4, 6 run on replica 0.
        long = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        results: dict[int, object] = {}
        started = [threading.Event() for _ in range(8)]

        def streaming(i):
            with requests.post(srv.url + "/v1/completions", json={**long, "prompt": [5, 6, i], "stream": True},
                               stream=True, timeout=120) as r:
                events = []
                for line in r.iter_lines():
                    if line:
                        started[i].set()
                        events.append(line)
                results[i] = (r.status_code, events)

        def plain(i):
            started[i].set()
            r = srv.post("/v1/completions", {**long, "prompt": [5, 6, i]})
            results[i] = (r.status_code, r.json())

        threads = []
        for i in range(8):
            threads.append(threading.Thread(target=streaming if i < 4 else plain, args=(i,)))
            threads[-1].start()
            deadline = time.monotonic() + 30
            while sum(r["num_requests_routed"] for r in _replicas(srv)) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        for event in started:
            assert event.wait(30)
        replicas = _replicas(srv)
        assert [r["num_requests_in_flight"] for r in replicas] == [4, 4], replicas
        os.kill(pids[0], signal.SIGKILL)

        deadline = time.monotonic() + 10
        while (health := srv.get("/health")).json()["status"] != "degraded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "replica 0" in health.json()["detail"] and health.json()["engine_core_pid"] == pids[1]
        assert [r["alive"] for r in health.json()["replicas"]] == [False, True]
        # New requests go to the survivor.
        for _ in range(3):
            r = srv.post("/v1/completions", {"prompt": [9, 9, 9], "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert [r["num_requests_routed"] for r in _replicas(srv)] == [4, 7]
        metrics = srv.get("/metrics").text
        assert 'verispec:dp_replica_alive{dp_rank="0",model_name="llama"} 0.0' in metrics
        assert srv.metrics()["verispec:engine_core_alive"] == 1

        for t in threads:
            t.join(120)
        for i in (0, 2):  # streamed on the dead replica: an error event, then [DONE]
            status, lines = results[i]
            assert status == 200 and lines[-1] == b"data: [DONE]"
            error = json.loads(lines[-2][len(b"data: "):])["error"]
            assert error["code"] == 503 and "not running" in error["message"]
        for i in (4, 6):  # not streamed: HTTP 503 in the OpenAI error shape
            status, body = results[i]
            assert status == 503 and body["error"]["code"] == 503 and body["error"]["type"] == "ServiceUnavailableError"
        for i in (1, 3):
            status, lines = results[i]
            assert status == 200 and lines[-1] == b"data: [DONE]" and b'"error"' not in lines[-2]
        for i in (5, 7):
            status, body = results[i]
            assert status == 200 and body["usage"]["completion_tokens"] == 1500

        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while srv.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = srv.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        r = srv.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 503 and r.headers.get("retry-after") and r.json()["error"]["code"] == 503
        assert srv.metrics()["verispec:engine_core_alive"] == 0
    finally:
        srv.stop()
