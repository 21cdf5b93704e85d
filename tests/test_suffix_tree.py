"""The suffix tree against brute force: after any appends and removals, the count of every pattern
is its number of occurrences in the sequences held, the structure's invariants hold, and drafts
follow the counts (the most frequent continuation, or a draw from the branch's distribution)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.spec_decode.suffix_tree import SuffixTree, suffix_tree_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def occurrences(seqs: dict[int, list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(1 for s in seqs.values() for i in range(len(s) - n + 1) if s[i:i + n] == pattern)


def continuations(seqs, pattern, depth):
    """{token: count} of what follows `pattern`, within the depth."""
    if len(pattern) + 1 > depth:
        return {}
    found = {}
    for s in seqs.values():
        for i in range(len(s) - len(pattern)):
            if s[i:i + len(pattern)] == pattern:
                t = s[i + len(pattern)]
                found[t] = found.get(t, 0) + 1
    return found


ops = st.lists(st.one_of(
    st.tuples(st.just("extend"), st.integers(0, 3), st.lists(st.integers(0, 3), max_size=12)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.just([])),
), max_size=12)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 6))
def test_counts_are_occurrences_after_any_appends_and_removals(program, depth):
    tree, seqs = SuffixTree(depth), {}
    for op, seq, tokens in program:
        if op == "extend":
            tree.extend(seq, tokens)
            seqs.setdefault(seq, []).extend(tokens)
        else:
            tree.remove(seq)
            seqs.pop(seq, None)
        assert tree.check() == ""
    assert tree.num_tokens == sum(map(len, seqs.values()))
    assert tree.count([]) == tree.num_tokens
    for n in range(1, depth + 1):
        for pattern in itertools.product(range(4), repeat=n):
            assert tree.count(list(pattern)) == occurrences(seqs, list(pattern)), pattern
    for seq in list(seqs):
        tree.remove(seq)
    assert tree.num_nodes == 1 and tree.check() == ""  # nothing left behind


def reference_walk(seqs, context, depth, limit, min_prob):
    """Brute-force greedy path from `context` (a matched suffix), as the tree should take it."""
    path, prob, score = [], 1.0, 0.0
    while len(path) < limit:
        here = context + path
        if len(here) >= depth:
            break
        nexts = continuations(seqs, here, depth)
        if not nexts:
            break
        total = occurrences(seqs, here)
        tok, count = min(nexts.items(), key=lambda kv: (-kv[1], kv[0]))
        if prob * count / total < min_prob:
            break
        prob *= count / total
        path.append(tok)
        score += prob
    return path, score


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=15), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(2, 6),
       st.sampled_from([0.0, 0.1, 0.3]), st.sampled_from([0.5, 1.0, 2.0]))
def test_greedy_draft_is_the_best_scoring_match_followed_by_its_most_frequent_path(
        sequences, context, depth, min_prob, factor):
    tree = SuffixTree(depth)
    seqs = dict(enumerate(sequences))
    for i, s in seqs.items():
        tree.extend(i, s)
    draft = tree.speculate(context, 8, factor, 0.0, min_prob)
    best = ([], 0.0, 0)
    for m in range(1, min(len(context), depth) + 1):
        suffix = context[-m:]
        if occurrences(seqs, suffix) == 0:
            break
        limit = min(8, int(m * factor + 1e-6))
        path, score = reference_walk(seqs, suffix, depth, limit, min_prob)
        if path and score >= best[1] - 1e-12:
            best = (path, score, m)
    assert draft.tokens == best[0]
    assert abs(draft.score - best[1]) < 1e-9
    if best[0]:
        assert draft.match_len == best[2]
    for j, (ids, probs) in enumerate(zip(draft.q_ids, draft.q_probs)):
        assert draft.tokens[j] in ids and abs(sum(probs) - 1.0) < 1e-12
        assert probs == sorted(probs, reverse=True)


def base_for(u_low: float, u_high: float, position: int = 0) -> int:
    """A noise base whose draw at `position` falls in [u_low, u_high)."""
    module = suffix_tree_module()
    return next(b for b in range(100000) if u_low <= module.uniform(b, position) < u_high)


def test_draws_follow_the_branch_distribution():
    """A branch seen 3 : 1 is drawn 3 : 1, and q says so."""
    tree = SuffixTree(8)
    for i, t in enumerate([7, 7, 7, 9]):
        tree.extend(i, [1, 2, t])
    picks = [tree.speculate([1, 2], 1, 1.0, 0.0, 0.0, base_for(lo, hi, 40), 40).tokens[0]
             for lo, hi in ((0.0, 0.2), (0.5, 0.74), (0.76, 0.8), (0.9, 1.0))]
    assert picks == [7, 7, 9, 9]
    draft = tree.speculate([1, 2], 1, 1.0, 0.0, 0.0, base_for(0.9, 1.0), 0)
    assert draft.q_ids == [[7, 9]] and draft.q_probs == [[0.75, 0.25]]
    assert draft.score == 0.75 and draft.confidence == [0.75]  # the greedy path's, whatever the draw
    counts = {7: 0, 9: 0}
    for base in range(4000):
        counts[tree.speculate([1, 2], 1, 1.0, 0.0, 0.0, base, 3).tokens[0]] += 1
    assert abs(counts[7] / 4000 - 0.75) < 4 * (0.75 * 0.25 / 4000) ** 0.5


def test_uniform_is_the_request_draft_noise():
    """The extension draws with RequestNoise's own `draft` keys (sample/noise.py)."""
    from verispec.sample.noise import RequestNoise, uniform
    noise, module = RequestNoise(1234), suffix_tree_module()
    for position in (0, 1, 77, 10**6):
        assert module.uniform(noise.bases["draft"], position) == uniform(noise.key("draft", position))


def test_a_branch_keeps_its_32_most_frequent_children():
    tree = SuffixTree(4)
    for t in range(100):
        tree.extend(t, [5, t])
        if t % 3 == 0:
            tree.extend(100 + t, [5, t])
    draft = tree.speculate([5], 1, 1.0, 0.0, 0.0, base_for(0.99, 1.0), 0)
    assert len(draft.q_ids[0]) == 32 and abs(sum(draft.q_probs[0]) - 1) < 1e-12
    assert draft.q_ids[0][:3] == [0, 3, 6]  # the twice-seen ones first, then by token id


def test_memory_is_linear_in_tokens_for_unrepeated_text():
    """A compressed tree: unrepeated text costs a bounded number of bytes per token, whatever the depth."""
    import random
    rng = random.Random(0)
    per_token = []
    for depth in (8, 24, 64):
        tree = SuffixTree(depth)
        for seq in range(20):
            tree.extend(seq, [rng.randrange(30000) for _ in range(500)])
        per_token.append(tree.memory_bytes() / tree.num_tokens)
        assert tree.num_nodes <= 2 * tree.num_tokens + 1
    assert max(per_token) < 2 * min(per_token)


def test_the_module_is_loaded_once():
    assert suffix_tree_module() is suffix_tree_module()


# A serving loop's heap: each step frees [rows, vocabulary] tensors of varying size while 16 requests'
# trees and the shared tree grow by a token each; with the engine's malloc settings (host_memory.py)
# those holes are the next step's memory.
STEPS_WITH_TREES = textwrap.dedent("""
    import random
    import torch
    from verispec.host_memory import keep_freed_memory
    from verispec.spec_decode.suffix_tree import SuffixTree
    keep_freed_memory()
    torch.set_num_threads(1)
    rng = random.Random(0)
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
    shared, local, marks = SuffixTree(24), {}, []
    for step in range(600):
        held = [torch.ones(rng.randint(14, 24), 49152) for _ in range(3)]
        if step % 100 == 0:  # a new batch of 16 requests, each with a tree over its prompt
            local = {i: SuffixTree(24) for i in range(16)}
            for tree in local.values():
                tree.extend(0, [rng.randrange(49152) for _ in range(60)])
        for i, tree in local.items():
            token = [rng.randrange(49152)]
            tree.extend(0, token)
            shared.extend(100 * (step // 100) + i, token)
        del held
        if step in (199, 599):
            marks.append(rss())
    print(marks[1] - marks[0])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set from /proc")
def test_trees_do_not_fragment_the_heap_a_step_reuses():
    """Nodes taken from malloc one by one land in the holes that freed tensors leave, so each step's
    tensors grow the heap instead: 416-444 MB over these 400 steps before each tree drew its nodes
    from its own pool, 7-11 MB after (the trees themselves hold about 2 MB of it)."""
    out = subprocess.run([sys.executable, "-c", STEPS_WITH_TREES], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    assert int(out) < 64 << 20
