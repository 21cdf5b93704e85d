"""Suffix decoding: drafts from suffix trees over the request's own tokens and over every request's
outputs (`speculative_config={"method": "suffix"}`, vLLM's parameter names and defaults).

- Each live request has a tree over its prompt and output (`local`). A global tree per
  `cache_salt` holds the outputs of live requests as they are emitted, each preceded by the last
  depth - 1 tokens of its prompt (so siblings of an n > 1 request, or later requests after the
  same prompt tail, draft even their first tokens from each other), and those of the last
  `max_cached_requests` finished ones. A salted request reads and feeds only its salt's tree:
  drafts taken from another tenant's text would leak it through timing.
- A draft follows the better-scoring tree (score: expected accepted tokens) from the suffix of
  the context that scores best; its length is at most `max_spec_factor` x the match length, and it
  stops where the path's probability times the next branch's peak falls below `min_token_prob`.
- Greedy requests, and requests with a grammar (whose drafts are cut to the grammar's valid
  prefix, one-hot as prompt lookup's), get the most frequent continuation. Random requests draw
  each branching token from the branch's distribution with their own `draft` noise, and that
  distribution is q for the rejection rule (sparse, host values): verification stays exact.
- Finished requests' outputs stay in the global tree; the oldest leave first once more than
  `max_cached_requests` requests or `max_cached_tokens` tokens are cached.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from verispec.config import SpeculativeConfig
from verispec.core.request import Request
from verispec.core.step_types import Drafts
from verispec.spec_decode.suffix_tree import SuffixTree, SuffixTreeUnavailable, suffix_tree_module

@dataclass(slots=True)
class _Live:
    """A live request's place in the trees."""

    local: object  # its own SuffixTree: prompt + output
    salt: str
    seq: int  # its sequence id in the salt's global tree
    num_synced: int  # of req.token_ids, how many are in its trees


@dataclass(slots=True)
class SuffixStats:
    cached_requests: int
    cached_tokens: int  # finished requests' tokens in the global trees
    global_tokens: int  # every token in the global trees (live requests' included)
    memory_bytes: int  # global trees and live requests' trees


class SuffixCache:
    """The trees, their updates (amortised O(depth) per token) and the FIFO of finished outputs."""

    def __init__(self, depth: int, max_cached_requests: int, max_cached_tokens: int):
        self.depth = depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.live: dict[str, _Live] = {}
        self.requests: dict[str, Request] = {}
        self.global_trees: dict[str, object] = {}
        self.finished: deque[tuple[str, int, int]] = deque()  # (salt, seq, tokens), oldest first
        self.cached_tokens = 0
        self._next_seq = 0

    def sync(self, req: Request) -> _Live:
        """The request's trees brought up to its tokens (created on first sight)."""
        live = self.live.get(req.request_id)
        if live is None:
            salt = req.params.cache_salt or ""
            local = SuffixTree(self.depth)
            local.extend(0, req.prompt_token_ids)
            live = _Live(local, salt, self._next_seq, req.num_prompt_tokens)
            self._next_seq += 1
            self.live[req.request_id] = live
            self.requests[req.request_id] = req
            tail = req.prompt_token_ids[-(self.depth - 1):] if self.depth > 1 else []
            if self.max_cached_requests > 0:
                self._tree(salt).extend(live.seq, tail)
        new = req.token_ids[live.num_synced:]
        if new:
            live.local.extend(0, new)
            if self.max_cached_requests > 0:
                self._tree(live.salt).extend(live.seq, new)
            live.num_synced = req.num_tokens
        return live

    def _tree(self, salt: str):
        tree = self.global_trees.get(salt)
        if tree is None:
            tree = self.global_trees[salt] = SuffixTree(self.depth)
        return tree

    def finish(self, request_id: str) -> None:
        """A finished (or aborted) request: its own tree goes, its output stays cached."""
        req = self.requests.pop(request_id)
        live = self.sync(req)
        del self.live[request_id]
        if self.max_cached_requests <= 0:
            return
        tokens = min(self.depth - 1, req.num_prompt_tokens) + req.num_output_tokens
        self.finished.append((live.salt, live.seq, tokens))
        self.cached_tokens += tokens
        while self.finished and (len(self.finished) > self.max_cached_requests
                                 or self.cached_tokens > self.max_cached_tokens):
            salt, seq, n = self.finished.popleft()
            tree = self.global_trees[salt]
            tree.remove(seq)
            self.cached_tokens -= n
            if tree.num_sequences == 0:
                del self.global_trees[salt]

    def speculate(self, req: Request, max_tokens: int, factor: float, min_prob: float, draw: bool):
        """The better of the request's own tree and its salt's global tree (None: no draft). The
        request's trees hold its tokens already: the drafter syncs every running request first."""
        live = self.live[req.request_id]
        context = req.token_ids[-self.depth:]
        # A random request draws with its `draft` noise at the drafts' own positions.
        draws = (req.noise.bases["draft"] if draw else None, req.num_tokens)
        best = live.local.speculate(context, max_tokens, factor, 0.0, min_prob, *draws)
        shared = self.global_trees.get(live.salt)
        if shared is not None:
            other = shared.speculate(context, max_tokens, factor, 0.0, min_prob, *draws)
            if other.score > best.score:
                best = other
        return best if best.match_len else None  # a draft has a match; reading .tokens copies them

    def stats(self) -> SuffixStats:
        trees = list(self.global_trees.values())
        return SuffixStats(
            cached_requests=len(self.finished),
            cached_tokens=self.cached_tokens,
            global_tokens=sum(t.num_tokens for t in trees),
            memory_bytes=sum(t.memory_bytes() for t in trees) + sum(x.local.memory_bytes() for x in self.live.values()),
        )


class SuffixDrafter:
    """Proposes at the end of a step, like prompt lookup, with q for random requests."""

    drafts_in_step = False
    calibrated = False

    def __init__(self, cfg: SpeculativeConfig):
        try:  # built (once per machine) and loaded at start-up, not in a request's first step
            suffix_tree_module()
        except SuffixTreeUnavailable as exc:
            raise RuntimeError(f"speculative_config method 'suffix' needs its C++ suffix tree: {exc}") from None
        self.factor = cfg.suffix_decoding_max_spec_factor
        self.min_prob = cfg.suffix_decoding_min_token_prob
        self.cache = SuffixCache(cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
                                 cfg.suffix_decoding_max_cached_tokens)

    def propose(self, running: list[Request], rooms: list[int]) -> dict[str, Drafts]:
        for req in running:  # every new token first: siblings draft from each other's latest
            self.cache.sync(req)
        out = {}
        for req, room in zip(running, rooms):
            if not room:
                continue
            one_hot = req.params.greedy or req.grammar is not None
            draft = self.cache.speculate(req, room, self.factor, self.min_prob, draw=not one_hot)
            if draft is None:
                continue
            drafts = draft.tokens  # each read of a Draft's field converts it to a new list
            if req.grammar is not None:  # only drafts the grammar allows can be verified
                drafts = drafts[: req.grammar.valid_prefix(drafts)]
            n = len(drafts)
            q = None if one_hot else tuple(zip(draft.q_ids, draft.q_probs))[:n]
            out[req.request_id] = Drafts(tuple(drafts), q, tuple(draft.confidence[:n]))
        return out

    def finish(self, request_id: str) -> None:
        """A request that left: its output stays in the global tree (if it was ever seen)."""
        if request_id in self.cache.requests:
            self.cache.finish(request_id)
