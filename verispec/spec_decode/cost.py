"""What a step costs, for adaptive verification's budget (spec_decode/adaptive.py): the target's
forward against the number of tokens in the step, profiled at start-up, plus what the measured
steps teach: an overhead that does not grow with the drafts, and what the drafting itself costs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

# How far one measured step moves the cost model's overhead toward the step's excess over its table.
COST_LEARNING_RATE = 0.2
# A draft rows' extra is learnt only within this many steps of a measure of its base.
RECENT_BASE = 16
# The profile also times n + 1 rows for every power of two n in this range (CostModel.profile):
# where a step's decode rows fill whole tiles, the first draft rows open a new one.
TILE_EDGE_MIN, TILE_EDGE_MAX = 4, 64


@dataclass(slots=True)
class CostModel:
    """Step cost (seconds) against the number of tokens in the step: a table interpolated
    linearly between grid points and extrapolated from the last two, plus a learnt `overhead`.

    A profiled table is the forward's own cost: what one more token (a draft row) adds. A real
    step also pays what does not grow with its drafts: the host's work per request (scheduling,
    detokenizing), attention over long contexts, whatever else the machine is doing.
    With `learn`, every measured step (its wall time, read on the host after the step's one
    synchronisation) moves `overhead` toward its excess over the table. Learning the table's
    points from steps by their token count alone priced a draft row at what a request costs (at
    5 requests a step took 13.6 ms against the table's 8.3: 2 ms per token against the
    forward's 0.55), and no draft paid; hence the keys below, which tell requests from drafts.

    A step that drafts also pays the drafting, which verifying no draft would not: a DSpark
    block forward took 3.1 ms of a 14 ms step on one CPU thread, and a drafter accepting 0.3
    tokens a step made the engine 0.6x plain while its verify rows alone looked worth it. Each
    measured step's drafting time is taken out of its excess and averaged in `drafting` (over
    the steps that drafted); `best_prefix` charges it to each request's first slot.

    The profile is only where the model starts. A step's own cost is learnt from the steps
    themselves, keyed by what shapes it: `base` (its non-draft tokens) and B (its draft rows),
    and the drafting by how many requests drafted. Profiled at start-up, beside the engine's
    other start-up threads, the table priced one token at 15.6-21 ms where the same forward
    took 8-12 ms a few seconds later (two threads), and its noise made the first draft row look
    free (1 -> 2 tokens flat after the never-falling fix) while it cost 3.3-4.5 ms, a third of
    a step: DSpark drafted on 87 % of its steps at 0.55-0.73x plain. Each (base, B) moves
    toward its measured steps; a pair never measured takes the profile's extra rows scaled by
    `row_scale`, what the measured extras have shown of the profile's error.

    A table the user gives is kept as given: it learns nothing."""

    tokens: list[int]
    seconds: list[float]
    learn: bool = False
    overhead: float = 0.0  # seconds per step beyond the table (learnt; may be negative)
    drafting: float = 0.0  # seconds a step's drafting takes (learnt; 0 for a given table)
    # Single lookups by token count: every step looks one up (0.1 ms through numpy each time).
    _memo: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    row_scale: float = 1.0  # measured extra rows' cost over the profile's (learnt)
    # Learnt: a step's seconds by base tokens (no drafts); its draft rows' extra by (base, B);
    # the drafting's seconds by how many requests drafted. Each value with its count of measures.
    _bases: dict[int, list] = field(default_factory=dict, init=False, repr=False, compare=False)
    _extras: dict[tuple[int, int], list] = field(default_factory=dict, init=False, repr=False, compare=False)
    _drafters: dict[int, list] = field(default_factory=dict, init=False, repr=False, compare=False)
    _base_seen: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _steps: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise ValueError("a cost table needs as many costs as token counts, and at least one")
        pairs = sorted(zip(self.tokens, self.seconds))
        self.tokens = [int(t) for t, _ in pairs]
        # A longer step never costs less: profiling noise must not make the objective jump.
        self.seconds = list(np.maximum.accumulate([max(float(s), 1e-9) for _, s in pairs]))

    def tables(self, num_tokens) -> np.ndarray:
        """The table's cost for every n of an integer array: interpolated, or extrapolated from
        the last two points past the last one. One computation serves a step's every budget
        (`best_prefix` weighs up to 193 a step) and the single lookups alike."""
        t, s = self.tokens, self.seconds
        n = np.asarray(num_tokens, dtype=np.int64)
        out = np.interp(n, t, s)
        if len(t) > 1:
            beyond = n > t[-1]
            slope = (s[-1] - s[-2]) / (t[-1] - t[-2])
            out[beyond] = s[-1] + slope * (n[beyond] - t[-1]).astype(np.float64)
        return out

    def table(self, num_tokens: int) -> float:
        if (cost := self._memo.get(num_tokens)) is None:
            cost = self._memo[num_tokens] = float(self.tables([num_tokens])[0])
        return cost

    def __call__(self, num_tokens: int) -> float:
        return self.table(num_tokens) + self.overhead

    def many(self, num_tokens) -> np.ndarray:
        """`self(n)` for every n of an integer array."""
        return self.tables(num_tokens) + self.overhead

    def base_cost(self, base: int) -> float:
        """A step of `base` tokens and no drafts: measured, else the table's cost and the overhead."""
        known = self._bases.get(base)
        return known[0] if known else self(base)

    def step_costs(self, base: int, budgets) -> np.ndarray:
        """The step's seconds with `base` non-draft tokens and B draft rows, for every B of an
        integer array, the drafting apart: the base's cost, and each B's extra as measured at this
        base, else the profile's extra rows scaled by `row_scale`. Never falling in B."""
        b = np.asarray(budgets, dtype=np.int64)
        extra = (self.tables(base + b) - self.table(base)) * self.row_scale
        if self._extras:
            for i, n in enumerate(b.tolist()):
                if n and (known := self._extras.get((base, n))):
                    extra[i] = known[0]
        return self.base_cost(base) + np.maximum.accumulate(np.maximum(extra, 0.0))

    def drafting_costs(self, num_drafting) -> np.ndarray:
        """Seconds of a step's drafting for each count of drafting requests (0: none): as measured
        for that count, else interpolated between the counts measured, proportional past the
        largest, the smallest's below it (a drafter's launch costs what one request does)."""
        d = np.asarray(num_drafting, dtype=np.int64)
        if not self._drafters:
            return np.where(d > 0, self.drafting, 0.0)
        keys = sorted(self._drafters)
        values = [self._drafters[k][0] for k in keys]
        out = np.interp(d, keys, values)
        beyond = d > keys[-1]
        out[beyond] = values[-1] * d[beyond] / keys[-1]
        return np.where(d > 0, out, 0.0)

    def observe(self, num_tokens: int, seconds: float, drafting: float = 0.0, num_drafts: int = 0,
                num_drafting: int = 0) -> None:
        """One measured step of `num_tokens` tokens, `num_drafts` of them draft rows, that spent
        `drafting` of its `seconds` drafting for `num_drafting` requests: each learnt value moves
        toward what this step shows (a running mean over its first measures, then an exponential
        average), and `overhead` toward the step's excess over the table. A step over twice its
        estimate counts at that bound."""
        if not self.learn or num_tokens < 1 or seconds <= 0:
            return
        if drafting > 0:
            # The first measure stands alone: from a prior of 0 the first steps' drafting looked free.
            first = self.drafting == 0
            self.drafting = drafting if first else self.drafting + COST_LEARNING_RATE * (drafting - self.drafting)
            seconds = max(seconds - drafting, 1e-9)
            if num_drafting:
                _learn(self._drafters, num_drafting, drafting)
        base = num_tokens - num_drafts
        self._steps += 1
        if num_drafts and base >= 1:
            # An extra is measured against a base measured lately: a step's cost grows with its
            # contexts, and in a long drafting streak (copying) an old base made every draft row
            # look dear.
            if self._steps - self._base_seen.get(base, -RECENT_BASE) < RECENT_BASE:  # never seen: -RECENT_BASE
                estimate = float(self.step_costs(base, [num_drafts])[0])
                extra = min(seconds, 2 * estimate) - self._bases[base][0]
                profiled = self.table(num_tokens) - self.table(base)
                if profiled > 0:
                    ratio = min(4.0, max(0.25, extra / profiled))
                    self.row_scale += COST_LEARNING_RATE * (ratio - self.row_scale)
                _learn(self._extras, (base, num_drafts), extra)
        elif not num_drafts:
            _learn(self._bases, base, min(seconds, 2 * self.base_cost(base)))
            self._base_seen[base] = self._steps
        # A step over twice its table's cost is an outlier (a graph compiled for a new shape, a
        # collection, a neighbour's burst): counted at that bound, or one such step of a second
        # priced the next ten steps' draft rows as nearly free (the overhead dwarfing them).
        table = self.table(num_tokens)
        excess = min(seconds - table, table)
        self.overhead += COST_LEARNING_RATE * (excess - self.overhead)
        self.overhead = max(self.overhead, -0.5 * self.seconds[0])

    @classmethod
    def profile(cls, model, block_size: int, max_tokens: int, device: torch.device) -> "CostModel":
        """Times one forward plus logits over n one-token sequences, n on a doubling grid and one
        past each power of two from TILE_EDGE_MIN to TILE_EDGE_MAX.

        Runs at start-up on a one-block scratch KV cache of its own, so the engine's pool is never
        touched; the best of a few runs is kept for the small, noisy sizes.
        """
        from verispec.models.attention import SeqSpan, build_attention_metadata

        powers = {1 << i for i in range(max(1, max_tokens).bit_length())}
        # Matmuls work in tiles of rows, so the first row past a power of two is a step up (16 ->
        # 17 rows: +3.8 ms exact, +1.9 ms fast, against 1.3 and 0.8 ms a row up to 32 on this
        # VM). A line from 16 to 32 spread that step over 16 rows and priced a batch of 16's
        # first drafts at a third of their cost; timing n + 1 too keeps the step in the table.
        edges = {n + 1 for n in powers if TILE_EDGE_MIN <= n <= TILE_EDGE_MAX and n < max_tokens}
        grid = sorted(powers | edges | {max(1, max_tokens)})
        runs = {n: 3 if n <= 16 else 2 if n <= 64 else 1 for n in grid}  # small steps are the noisy ones
        kv = model.new_kv_cache(1, block_size)
        best = dict.fromkeys(grid, math.inf)
        with torch.inference_mode():  # inference tensors, as the engine's steps
            steps = {}
            for n in grid:
                meta = build_attention_metadata([SeqSpan(i, 1, 1, [0]) for i in range(n)], block_size, device,
                                                model.dtype)
                zeros = torch.zeros(n, dtype=torch.long, device=device)
                steps[n] = (zeros, zeros, meta)  # token 0 at position 0, n sequences
            # The sizes take turns within each round: a slow spell of a shared machine then hits
            # every size alike instead of bending the table's slope.
            for rnd in range(max(runs.values())):
                for n in (n for n in grid if rnd < runs[n]):
                    ids, pos, meta = steps[n]
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.compute_logits(model(ids, pos, meta, kv.layers)).softmax(dim=-1)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    best[n] = min(best[n], time.perf_counter() - t0)
        return cls(grid, [best[n] for n in grid], learn=True)


def _learn(table: dict, key, value: float) -> None:
    """Moves table[key] ([value, count]) toward `value`: the mean of its first measures, then an
    exponential average at COST_LEARNING_RATE (one step's wall time on a shared VM is noisy)."""
    entry = table.get(key)
    if entry is None:
        table[key] = [value, 1]
        return
    entry[1] += 1
    entry[0] += max(COST_LEARNING_RATE, 1.0 / entry[1]) * (value - entry[0])
