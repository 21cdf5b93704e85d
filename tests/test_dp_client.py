"""Data parallelism's parts (engine/dp_client.py): the router alone and the client's bookkeeping
over stand-in replicas (end to end: test_data_parallel.py)."""

from __future__ import annotations

import asyncio

import pytest

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

    monkeypatch.setattr(dp, "available_cores", lambda: 2)
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
