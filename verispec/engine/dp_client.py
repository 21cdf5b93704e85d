"""Data parallelism: N engine-core replicas behind one API server (`verispec serve --data-parallel-size N`).

Each replica is a whole engine in its own core process (`AsyncEngineClient`), with its own KV cache
and prefix cache. The frontend routes every engine request to one live replica:

- **shortest queue**: the replica with the fewest requests routed to it and not yet finished
  (counted here, in the frontend: the cores' own counts arrive a step late);
- **prefix-aware**: the frontend remembers, per replica, the chained block hashes of the prompts it
  sent there (a bounded LRU). A request goes to the replica holding its longest remembered prefix
  (at least one full block) unless that replica's queue is longer than the shortest by more than
  max(2, 25% of the shortest): then the shortest queue wins, and the prefix spreads to a second
  replica. `cache_salt` is the root of the chain, so a salted request only matches its own salt.

A replica whose core process exits is taken out of rotation: its in-flight requests fail with
`EngineDeadError` (503, as with one core), new requests go to the others, and only when every
replica is gone is the client `dead`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from verispec.config import EngineConfig
from verispec.cores import available_cores
from verispec.engine.core_client import AsyncEngineClient, EngineDeadError
from verispec.engine.core_protocol import ControlReply, CoreReady, EngineStats, RequestDelta
from verispec.core.kv_cache import chain_hash
from verispec.sampling_params import SamplingParams

logger = logging.getLogger("verispec.dp")

# The engine's stats that describe the present (summed over live replicas only: a dead replica
# holds no requests and no blocks). Every other field is a counter, summed over all replicas with
# a dead one's last values kept, so totals never go down.
GAUGE_STATS = frozenset({"num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "prefix_cache_blocks",
                         "prefix_cache_prompt_rows_bytes"})

_UNSALTED_ROOT = b"verispec-dp-unsalted"


def check_data_parallel_size(size: object) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"--data-parallel-size must be an integer >= 1; got {size!r}")
    return size




def replica_config(config: EngineConfig, dp_rank: int, dp_size: int) -> EngineConfig:
    """The engine config of one replica: a copy, so the caller's config is never changed.

    With one replica it is the config itself (the server behaves as without data parallelism).
    Otherwise each core defaults to its share of the CPUs (N cores each taking every CPU would
    oversubscribe them), and each replica gets its own seed: unseeded requests draw their noise
    seeds from the engine's seed, and two replicas with one seed would hand the k-th unseeded
    request of each the same draws.
    """
    if dp_size == 1:
        return config
    threads = config.num_threads if config.num_threads else max(1, available_cores() // dp_size)
    seed = config.seed if dp_rank == 0 else (config.seed + dp_rank * 0x9E3779B97F4A7C15) % (1 << 63)
    return dataclasses.replace(config, num_threads=threads, seed=seed)


def sum_stats(stats: Sequence[EngineStats], alive: Sequence[bool]) -> EngineStats:
    """One snapshot for the server's metrics: counters summed over every replica, gauges over live
    ones, per-index lists (accepted per draft position, capacity histogram) summed elementwise."""
    values: dict = {}
    for name in EngineStats.__struct_fields__:
        parts = [getattr(s, name) for s, live in zip(stats, alive) if live or name not in GAUGE_STATS]
        if name in ("weight_version", "num_weight_updates"):  # every replica takes each update: one value
            values[name] = parts[0] if len(set(parts)) == 1 else ("mixed" if name == "weight_version" else max(parts))
        elif parts and isinstance(parts[0], list):
            width = max(len(p) for p in parts)
            values[name] = [sum(p[i] for p in parts if i < len(p)) for i in range(width)]
        else:
            values[name] = sum(parts)
    return EngineStats(**values)


# ----------------------------------------------------------------------------------- routing
@dataclass(slots=True)
class ReplicaLoad:
    """What the frontend knows of one replica."""

    alive: bool = True
    in_flight: int = 0  # routed here and not finished
    routed: int = 0  # requests routed here since start
    prefix_hits: int = 0  # of which: sent where at least one block of the prompt was remembered
    # Chained block hashes of prompts routed here, least recently used first.
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


class DPRouter:
    """Chooses a replica per request. Pure bookkeeping: no I/O, no clock, so it is unit-tested alone."""

    def __init__(self, num_replicas: int, block_size: int, *, max_blocks_per_replica: int = 4096,
                 prefix_aware: bool = True, slack_requests: int = 2, slack_fraction: float = 0.25):
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.block_size = block_size
        # The engine cannot keep more blocks cached than its pool holds; the client sets this to
        # the replica's pool size, so the memory here is about as long as the engine's.
        self.max_blocks_per_replica = max_blocks_per_replica
        self.prefix_aware = prefix_aware
        self.slack_requests = slack_requests
        self.slack_fraction = slack_fraction

    def block_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """One hash per full block of the prompt, each chained to the one before it."""
        if not self.prefix_aware:
            return []
        parent = hashlib.sha256(b"salt:" + cache_salt.encode()).digest() if cache_salt else _UNSALTED_ROOT
        out = []
        bs = self.block_size
        for start in range(0, len(prompt_token_ids) - bs + 1, bs):
            parent = chain_hash(parent, list(prompt_token_ids[start:start + bs]))
            out.append(parent)
        return out

    def cached_blocks(self, rank: int, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the prompt replica `rank` is remembered to hold."""
        blocks = self.replicas[rank].blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def choose(self, hashes: Sequence[bytes]) -> tuple[int, int] | None:
        """(replica, blocks of the prompt it is remembered to hold), or None when no replica is
        alive. Changes nothing."""
        live = [r for r, load in enumerate(self.replicas) if load.alive]
        if not live:
            return None
        # Ties go to the replica that has served fewer requests, so a burst that finds every queue
        # empty still alternates.
        shortest = min(live, key=lambda r: (self.replicas[r].in_flight, self.replicas[r].routed, r))
        if not hashes:
            return shortest, 0
        hits = {r: self.cached_blocks(r, hashes) for r in live}
        best = min(live, key=lambda r: (-hits[r], self.replicas[r].in_flight, self.replicas[r].routed, r))
        if hits[best] == 0:
            return shortest, 0
        q_min = self.replicas[shortest].in_flight
        slack = max(self.slack_requests, int(self.slack_fraction * q_min))
        if self.replicas[best].in_flight - q_min > slack:
            # The cache is not worth waiting behind that many requests; the prefix now spreads
            # to a second replica, and later requests sharing it find both.
            return shortest, hits[shortest]
        return best, hits[best]

    def assign(self, rank: int, hashes: Sequence[bytes], cached_blocks: int = 0) -> None:
        load = self.replicas[rank]
        load.in_flight += 1
        load.routed += 1
        load.prefix_hits += cached_blocks > 0
        # Leaves first, the root last: the root ends up most recently used, so eviction drops a
        # chain from its tail and the prefix shared by most prompts stays longest.
        for h in reversed(hashes):
            load.blocks[h] = None
            load.blocks.move_to_end(h)
        while len(load.blocks) > self.max_blocks_per_replica:
            load.blocks.popitem(last=False)

    def route(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        hashes = self.block_hashes(prompt_token_ids, cache_salt)
        choice = self.choose(hashes)
        if choice is None:
            return None
        self.assign(choice[0], hashes, choice[1])
        return choice[0]

    def finish(self, rank: int) -> None:
        self.replicas[rank].in_flight -= 1

    def mark_dead(self, rank: int) -> None:
        load = self.replicas[rank]
        load.alive = False
        load.blocks.clear()

    def reset_prefix_memory(self) -> None:
        for load in self.replicas:
            load.blocks.clear()


# ------------------------------------------------------------------------------------ client
@dataclass(slots=True)
class ReplicaInfo:
    """One replica as /health and /metrics show it."""

    dp_rank: int
    pid: int | None
    alive: bool
    dead_reason: str
    in_flight: int
    routed: int
    prefix_hits: int


class DPEngineClient:
    """The server's handle on N engine cores, with `AsyncEngineClient`'s interface."""

    def __init__(self, config: EngineConfig, data_parallel_size: int = 1):
        self.data_parallel_size = check_data_parallel_size(data_parallel_size)
        self.config = config
        self.replicas = [AsyncEngineClient(replica_config(config, rank, data_parallel_size))
                         for rank in range(data_parallel_size)]
        # With one replica there is nothing to choose: no prompt is hashed.
        self.router = DPRouter(data_parallel_size, config.block_size,
                               prefix_aware=config.enable_prefix_caching and data_parallel_size > 1)
        self._owner: dict[str, int] = {}  # request id -> the replica running it
        self._stats_listeners: list = []
        for replica in self.replicas:
            replica.add_stats_listener(self._on_replica_stats)

    # ------------------------------------------------------------------ lifecycle
    def launch(self) -> None:
        """Starts every core process now; `start` waits for them."""
        for replica in self.replicas:
            replica.launch()

    async def start(self, timeout_s: float = 900.0) -> None:
        """Starts every core at once; if any fails, the first error is raised after all have
        settled (the caller's shutdown then finds no core still loading)."""
        results = await asyncio.gather(*(r.start(timeout_s) for r in self.replicas), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        pool = self.replicas[0].ready.stats.kv_blocks_total
        if pool:
            self.router.max_blocks_per_replica = pool

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)

    def add_stats_listener(self, fn) -> None:
        self._stats_listeners.append(fn)

    def _on_replica_stats(self, _stats: EngineStats) -> None:
        """Any replica's new stats: the listeners get the sum over all of them."""
        if self._stats_listeners:
            stats = self.stats
            for fn in self._stats_listeners:
                fn(stats)  # the replica's client logs a listener's failure

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> CoreReady | None:
        return self.replicas[0].ready  # every replica loads the same model and limits

    @property
    def dead(self) -> bool:
        return all(r.dead for r in self.replicas)

    @property
    def dead_reason(self) -> str:
        if self.data_parallel_size == 1:
            return self.replicas[0].dead_reason
        return "; ".join(f"replica {rank}: {r.dead_reason}" for rank, r in enumerate(self.replicas) if r.dead)

    @property
    def core_pid(self) -> int | None:
        """The first live replica's core (with one replica: its core, live or not)."""
        live = [r for r in self.replicas if not r.dead]
        return (live[0] if live else self.replicas[0]).core_pid

    @property
    def stats(self) -> EngineStats:
        if self.data_parallel_size == 1:
            return self.replicas[0].stats
        return sum_stats([r.stats for r in self.replicas], [not r.dead for r in self.replicas])

    def _sync_alive(self) -> None:
        """Takes replicas whose core the watchdog found gone out of rotation."""
        for rank, replica in enumerate(self.replicas):
            if replica.dead and self.router.replicas[rank].alive:
                self.router.mark_dead(rank)
                live = sum(load.alive for load in self.router.replicas)
                logger.error("data-parallel replica %d is down (%s); %d of %d replicas serve",
                             rank, replica.dead_reason, live, self.data_parallel_size)

    def replica_info(self) -> list[ReplicaInfo]:
        self._sync_alive()
        return [ReplicaInfo(rank, r.core_pid, not r.dead, r.dead_reason, load.in_flight, load.routed,
                            load.prefix_hits)
                for rank, (r, load) in enumerate(zip(self.replicas, self.router.replicas))]

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, group: str | None = None
    ) -> AsyncIterator[RequestDelta]:
        """The request's deltas from the replica it was routed to. A replica that dies under it
        fails it with EngineDeadError (not retried elsewhere: it may have streamed already)."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already running")
        self._sync_alive()
        rank = self.router.route(prompt_token_ids, params.cache_salt)
        if rank is None:
            raise EngineDeadError(self.dead_reason)
        self._owner[request_id] = rank
        try:
            # aclosing: leaving this generator closes the replica's at once, whose `finally`
            # aborts the request in its core.
            async with aclosing(self.replicas[rank].generate(request_id, prompt_token_ids, params, group)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self._owner.pop(request_id, None)
            self.router.finish(rank)

    def abort(self, request_ids: list[str]) -> None:
        """Not a coroutine, as `AsyncEngineClient.abort`: each id goes to the replica running it."""
        if self.data_parallel_size == 1:
            self.replicas[0].abort(request_ids)
            return
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self._owner:
                by_rank.setdefault(self._owner[rid], []).append(rid)
        for rank, ids in by_rank.items():
            self.replicas[rank].abort(ids)

    def reset_prefix_cache(self) -> None:
        """Every live replica forgets its cached prefixes, and the frontend its memory of them."""
        live = [r for r in self.replicas if not r.dead]
        if not live:
            raise EngineDeadError(self.dead_reason)
        for replica in live:
            replica.reset_prefix_cache()
        self.router.reset_prefix_memory()

    # ------------------------------------------------------------------ control (engine/pause.py)
    async def pause_generation(self, mode: str) -> ControlReply:
        return await self._every_replica(lambda r: r.pause_generation(mode))

    async def continue_generation(self) -> ControlReply:
        return await self._every_replica(lambda r: r.continue_generation())

    async def update_weights_from_disk(self, path: str, weight_version: int | str | None) -> ControlReply:
        reply = await self._every_replica(lambda r: r.update_weights_from_disk(path, weight_version))
        if reply.ok:
            self.router.reset_prefix_memory()  # the replicas emptied their prefix caches
        return reply

    async def init_weights_update_group(self, **spec) -> ControlReply:
        if self.data_parallel_size > 1:  # each replica would need its own ranks in the trainer's group
            return ControlReply(0, False, "a trainer's weight group needs data_parallel_size 1", "invalid")
        return await self.replicas[0].init_weights_update_group(**spec)

    async def update_weights_from_distributed(self, names, dtypes, shapes, weight_version) -> ControlReply:
        reply = await self._every_replica(lambda r: r.update_weights_from_distributed(names, dtypes, shapes,
                                                                                      weight_version))
        if reply.ok:
            self.router.reset_prefix_memory()
        return reply

    async def _every_replica(self, call) -> ControlReply:
        """The same control input to every live replica: the first refusal, else replica 0's reply."""
        live = [r for r in self.replicas if not r.dead]
        if not live:
            raise EngineDeadError(self.dead_reason)
        replies = await asyncio.gather(*(call(r) for r in live))
        return next((r for r in replies if not r.ok), replies[0])
