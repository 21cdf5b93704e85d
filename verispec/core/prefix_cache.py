"""Automatic prefix caching: full KV blocks found by a chained hash, and the prompt-logprob rows
scored over them kept beside them.

A full block's hash chains its parent's hash with its token ids. The chain's root holds the extra
keys: the engine's model and precision tier, and the request's `cache_salt`. The hash is SHA-256,
so a collision (another prompt's KV returned for this one) is not a practical concern; blocks are
not compared token by token on a hit.

Prompt-logprob rows are cached per block: the B rows computed at a block's positions, keyed by
the block's hash, the request's scoring key (`prompt_rows_key`) and the token after the block
(the last row's own token lies there). A hit that skips prompt positions whose rows a request
still needs reads those rows from here. Where they are missing it is cut back to the last block
before the first such position, so the request computes them: the values are a cold
computation's either way. The rows' memory is bounded by `prompt_logprobs_cache_bytes`, evicted
least recently used first, and a block's rows leave with its KV.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from verispec.core.kv_cache import BlockPool, chain_hash
from verispec.core.request import Request
from verispec.outputs import LogprobsLists
from verispec.sample.prompt_logprobs import prompt_rows_key


@dataclass(slots=True)
class PrefixHit:
    blocks: list[int]  # cached blocks the request starts with
    num_tokens: int  # positions they cover: computed already
    # (first position, rows) of prompt logprobs read from the cache, for positions the hit skips.
    prompt_rows: tuple[int, LogprobsLists] | None = None


@dataclass(slots=True)
class _RowSet:
    width: int  # the prompt_logprobs count the rows were scored with (-1: every token)
    rows: LogprobsLists

    def serves(self, width: int | None) -> bool:
        want = width or 0
        return self.width == -1 or (want != -1 and self.width >= want)

    @property
    def nbytes(self) -> int:
        r = self.rows
        return r.logprob_token_ids.nbytes + r.logprobs.nbytes + r.selected_token_ranks.nbytes


class PromptRowCache:
    """Prompt-logprob rows by (block hash, scoring key, next token), within a byte budget."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self._sets: OrderedDict[tuple, _RowSet] = OrderedDict()  # least recently used first
        self._by_hash: dict[bytes, set[tuple]] = {}

    def get(self, block_hash: bytes, key: tuple, next_token: int, width: int | None) -> LogprobsLists | None:
        """Rows for a request asking for `width` alternatives (-1: every token): a wider set serves."""
        full = (block_hash, key, next_token)
        found = self._sets.get(full)
        if found is None or not found.serves(width):
            return None
        self._sets.move_to_end(full)
        return found.rows

    def put(self, block_hash: bytes, key: tuple, next_token: int, width: int | None, rows: LogprobsLists) -> None:
        full = (block_hash, key, next_token)
        old = self._sets.get(full)
        if old is not None and old.serves(width):
            self._sets.move_to_end(full)
            return
        new = _RowSet(width or 0, LogprobsLists(rows.logprob_token_ids.astype(np.int32), rows.logprobs.copy(),
                                                rows.selected_token_ranks.astype(np.int32)))
        if new.nbytes > self.budget_bytes:
            return
        if old is not None:
            self._remove(full)
        self._sets[full] = new
        self._by_hash.setdefault(block_hash, set()).add(full)
        self.num_bytes += new.nbytes
        while self.num_bytes > self.budget_bytes:
            self._remove(next(iter(self._sets)))

    def drop(self, block_hash: bytes) -> None:
        """The block left the KV cache: its rows go too."""
        for full in self._by_hash.pop(block_hash, ()):
            self.num_bytes -= self._sets.pop(full).nbytes

    def clear(self) -> None:
        self._sets.clear()
        self._by_hash.clear()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._sets)

    def _remove(self, full: tuple) -> None:
        self.num_bytes -= self._sets.pop(full).nbytes
        keys = self._by_hash[full[0]]
        keys.discard(full)
        if not keys:
            del self._by_hash[full[0]]


@dataclass(slots=True)
class _Progress:
    """A request's place in the cache, kept from its first admission until it finishes (a
    preempted request keeps its hashes)."""

    block_hashes: list[bytes] = field(default_factory=list)  # the chain of its full blocks' hashes
    num_cached_blocks: int = 0  # leading blocks of its table that are cached
    epoch: int = 0  # the cache's epoch at admission (a reset ends it)
    pending_rows: tuple[int, LogprobsLists] | None = None  # scored prompt rows of a block not yet whole


class PrefixCache:
    """Finds a waiting request's cached prefix, caches blocks as requests fill them, and keeps
    the prompt rows scored over cached blocks. Disabled, it finds nothing and caches nothing."""

    def __init__(self, pool: BlockPool, engine_key: str, enabled: bool = True, rows_budget_bytes: int = 0):
        self.pool = pool
        self.enabled = enabled
        self._root = hashlib.sha256(engine_key.encode()).digest()
        self.rows = PromptRowCache(rows_budget_bytes)
        pool.on_evict = self.rows.drop
        self.num_queries = 0  # prompt tokens looked up at admission
        self.num_hits = 0  # of which found cached
        self.num_prompt_rows_hit = 0  # prompt-logprob rows read instead of computed
        # Bumped by reset: requests admitted before it never cache again (their KV may predate
        # a weight update, and attention carries it into every later block).
        self.epoch = 0
        self._progress: dict[str, _Progress] = {}

    def finish(self, request_id: str) -> None:
        """The request left the engine: its progress goes (its cached blocks stay)."""
        self._progress.pop(request_id, None)

    def _of(self, req: Request) -> _Progress:
        progress = self._progress.get(req.request_id)
        if progress is None:
            progress = self._progress[req.request_id] = _Progress()
        return progress

    # ------------------------------------------------------------------ hashes
    def block_hashes(self, req: Request) -> list[bytes]:
        """The request's chain of full-block hashes, extended to its current tokens."""
        hashes, size = self._of(req).block_hashes, self.pool.block_size
        if len(hashes) < len(req.token_ids) // size:
            parent = hashes[-1] if hashes else self._salted_root(req.params.cache_salt)
            for b in range(len(hashes), len(req.token_ids) // size):
                parent = chain_hash(parent, req.token_ids[b * size : (b + 1) * size])
                hashes.append(parent)
        return hashes

    def _salted_root(self, salt: str | None) -> bytes:
        return self._root if salt is None else hashlib.sha256(self._root + b"salt:" + salt.encode()).digest()

    # ------------------------------------------------------------------ admission
    def find(self, req: Request) -> PrefixHit:
        """The longest usable cached prefix of a request about to be admitted."""
        if not self.enabled:
            return PrefixHit([], 0)
        hashes = self.block_hashes(req)
        # The last token is always computed: its row is sampled.
        blocks = self.pool.lookup(hashes[: (req.num_tokens - 1) // self.pool.block_size])
        rows = None
        if req.scores_prompt:
            blocks, rows = self._with_prompt_rows(req, blocks, hashes)
        return PrefixHit(blocks, len(blocks) * self.pool.block_size, rows)

    def _with_prompt_rows(self, req: Request, blocks: list[int], hashes: list[bytes]):
        """Cuts the hit back so that every prompt row it skips is read from the cache."""
        size, first = self.pool.block_size, req.num_prompt_logprob_rows
        end = req.num_prompt_tokens - 1  # rows at positions [first, end) are still wanted
        key, width = _rows_key(req), req.params.prompt_logprobs
        parts, b = [], first // size  # blocks before b hold no wanted row
        while b < len(blocks) and b * size < end:
            # A hit never covers the last prompt token, so the token after a hit block is a prompt token.
            rows = self.rows.get(hashes[b], key, req.token_ids[(b + 1) * size], width)
            if rows is None:
                blocks = blocks[:b]
                break
            parts.append(rows.rows(max(first - b * size, 0)))
            b += 1
        return blocks, ((first, LogprobsLists.cat(parts)) if parts else None)

    def admitted(self, req: Request, hit: PrefixHit) -> None:
        """Sets the request's cache state on (re)admission: what a preemption left is stale."""
        if not self.enabled:
            return
        progress = self._of(req)
        progress.num_cached_blocks, progress.pending_rows, progress.epoch = len(hit.blocks), None, self.epoch
        self.num_queries += req.num_tokens
        self.num_hits += hit.num_tokens
        if hit.prompt_rows is not None:
            self.num_prompt_rows_hit += len(hit.prompt_rows[1])

    # ------------------------------------------------------------------ after a step
    def cache_computed(self, req: Request) -> None:
        """Caches the request's blocks that are now full of computed tokens."""
        if not self.enabled or (progress := self._of(req)).epoch != self.epoch:
            return
        full = min(req.num_computed_tokens, req.num_tokens) // self.pool.block_size
        if full > progress.num_cached_blocks:
            hashes = self.block_hashes(req)
            self.pool.register(req.request_id, progress.num_cached_blocks, hashes[progress.num_cached_blocks : full])
            progress.num_cached_blocks = full

    def cache_prompt_rows(self, req: Request, first: int, rows: LogprobsLists) -> None:
        """Keeps the rows of every cached block whose positions are now all scored; rows of a block
        still partly unscored wait on the request."""
        if not self.enabled or not self.rows.budget_bytes or (progress := self._of(req)).epoch != self.epoch:
            return
        pending = progress.pending_rows
        if pending is not None and pending[0] + len(pending[1]) == first:
            first, rows = pending[0], LogprobsLists.cat([pending[1], rows])
        size, end, last = self.pool.block_size, first + len(rows), req.num_prompt_tokens - 1
        key = _rows_key(req)
        hashes = self.block_hashes(req)
        b = -(-first // size)
        # Block b's rows are at positions [b*B, (b+1)*B); the last of them predicts prompt token (b+1)*B.
        while (b + 1) * size <= min(end, last):
            if hashes[b] in self.pool.cached:
                block_rows = rows.rows(b * size - first, (b + 1) * size - first)
                self.rows.put(hashes[b], key, req.token_ids[(b + 1) * size], req.params.prompt_logprobs, block_rows)
            b += 1
        rest = max(b * size, first)
        completes = rest < end and (b + 1) * size <= last  # a later chunk can still complete block b
        progress.pending_rows = (rest, rows.rows(rest - first)) if completes else None

    # ------------------------------------------------------------------ whole cache
    def reset(self) -> None:
        self.epoch += 1
        self.pool.reset_cache()
        self.rows.clear()


def _rows_key(req: Request) -> tuple:
    """What besides the prefix decides a request's prompt rows: a scored completion's rows see it
    as output (engine/scoring.py)."""
    return prompt_rows_key(req.params, req.logprobs_mode) + (req.scored.rows_key if req.scored is not None else ())
