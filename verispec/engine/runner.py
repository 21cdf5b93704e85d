"""The model runner: flat batch in, sampled tokens and logprobs out, with one D2H copy per step.

Steps (DESIGN.md section 2): build the flat batch and the attention metadata on the host, run one
forward, compute logits only for the rows that are sampled, process them per request, sample,
score logprobs in each request's own mode, then copy everything to the host at once and
synchronise a single time.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field

import torch

from verispec.config import EngineConfig, LogprobsMode
from verispec.engine.kv_cache import BlockPool, KVCacheTensors
from verispec.engine.request import Request
from verispec.engine.scheduler import SchedulerOutput
from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.models.llama import LlamaModel
from verispec.outputs import LogprobsLists, LogprobsTensors
from verispec.sample.logprobs import compute_topk_scores
from verispec.sample.metadata import RowSpec, SamplingMetadata
from verispec.sample.processors import apply_processors
from verispec.sample.prompt_logprobs import score_prompt_rows
from verispec.sample.sampler import sample
from verispec.spec_decode.rejection import verify


def _contains_run(ids: list[int], run: list[int]) -> bool:
    n = len(run)
    return any(ids[i : i + n] == run for i, t in enumerate(ids) if t == run[0])


@dataclass(slots=True)
class StepResult:
    """Host-side results of one step, keyed by request id."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    # Per request: its logprob rows (one per emitted token), already on the host.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Per request: (first prompt position scored, rows predicting the following prompt tokens).
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    # Per speculating request: how many of its drafts were accepted.
    num_accepted: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class FlatBatch:
    input_ids: list[int]
    positions: list[int]
    spans: list[SeqSpan]
    sample_rows: list[int]  # flat rows whose logits are sampled or verified
    sample_reqs: list[Request]
    drafts: list[list[int]]  # per sampled request: its draft tokens (empty: plain sampling)
    draft_probs: list[torch.Tensor | None]  # per sampled request: q rows [k, V] (None: one-hot)
    draft_tensors: list[torch.Tensor | None]  # per sampled request: device draft values, if any
    draft_fill: list[tuple[int, torch.Tensor]]  # (first flat row, device drafts) to write into input_ids
    # (request, first flat row, first prompt position, end position) of prompt rows to score
    prompt_jobs: list[tuple[Request, int, int, int]]


@dataclass(slots=True)
class SampleOutput:
    sampled: torch.Tensor  # [R, K+1] emitted tokens, -1 padded (K = 0 without drafts)
    num_sampled: torch.Tensor  # [R]
    logprobs: LogprobsTensors | None
    lp_start: dict[int, int]  # request index -> its first row in `logprobs` (host layout)


def row_spec(req: Request, purpose: str | None, drafts: list[int] = ()) -> RowSpec:
    """The row that emits the token after req's tokens plus `drafts`; purpose None: never sampled."""
    p = req.params
    return RowSpec(
        params=p,
        prompt_ids=req.prompt_token_ids,
        output_ids=req.output_token_ids + list(drafts),
        noise=req.noise if purpose is not None else None,
        purpose=purpose or "sample",
        stop_ids=req.stop_ids,
        mode=req.logprobs_mode,
        num_logprobs=p.logprobs,
    )


def score_rows(
    raw: torch.Tensor, processed: torch.Tensor, selected: torch.Tensor, rows: list[RowSpec], vocab: int
) -> tuple[LogprobsTensors | None, list[int]]:
    """Logprobs for the rows that asked for them, each in its own mode.

    Rows are grouped by (mode, custom ids or top-k) so each group is one batched call; the result's
    rows follow the returned order (indices into `rows`).
    """
    groups: dict[tuple[LogprobsMode, bool], list[int]] = {}
    for i, r in enumerate(rows):
        if r.num_logprobs is not None or r.params.logprob_token_ids is not None:
            groups.setdefault((r.mode, r.params.logprob_token_ids is not None), []).append(i)
    if not groups:
        return None, []
    chunks, order = [], []
    for (mode, custom), idx in groups.items():
        index = torch.tensor(idx, dtype=torch.long, device=raw.device)
        source = (raw if mode.is_raw else processed)[index]
        custom_ids = None
        k = 0
        if custom:
            lists = [rows[i].params.logprob_token_ids for i in idx]
            width = max(len(x) for x in lists)
            custom_ids = torch.tensor([x + x[:1] * (width - len(x)) for x in lists], device=raw.device)
        else:
            ks = [rows[i].num_logprobs for i in idx]
            k = vocab if -1 in ks else max(ks)
        chunks.append(compute_topk_scores(source, k, selected[index], custom_ids, mode.is_logprobs))
        order.extend(idx)
    return LogprobsTensors.cat(chunks), order


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig, pool: BlockPool):
        self.model = model
        self.config = config
        self.device = config.device
        self.pool = pool
        self.vocab_size = model.cfg.vocab_size
        self.kv = KVCacheTensors(model.cfg, pool.num_blocks, pool.block_size, model.dtype, self.device)
        self.drafter = None  # a model-based drafter drafts inside the step, before the verify forward
        # Test hook for crash isolation: a step whose batch feeds this run of token ids raises, as
        # a model error would. Read once from the environment so a server's core process can be
        # armed; a run of several ids keeps random (fuzzed) prompts from tripping it by chance.
        fault = os.environ.get("VERISPEC_FAULT_INJECT_TOKENS")
        self.fault_tokens: list[int] | None = [int(t) for t in fault.split(",")] if fault else None

    def build_batch(self, sched: SchedulerOutput) -> FlatBatch:
        batch = FlatBatch([], [], [], [], [], [], [], [], [], [])
        for s in sched.scheduled:
            req, n, spec = s.request, s.num_new_tokens, s.spec_tokens
            start, done = len(batch.input_ids), req.num_computed_tokens
            total = n + len(spec)
            batch.input_ids.extend(req.token_ids[done : done + n])
            batch.input_ids.extend(spec)
            batch.positions.extend(range(done, done + total))
            batch.spans.append(SeqSpan(start, total, done + total, self.pool.table(req.request_id)))
            if s.samples:
                # The last known token's row, then one row per draft: 1 + k verify rows.
                batch.sample_rows.extend(range(start + n - 1, start + total))
                batch.sample_reqs.append(req)
                batch.drafts.append(spec)
                batch.draft_probs.append(req.draft_probs if spec else None)
                batch.draft_tensors.append(req.draft_tensor if spec else None)
            if spec and req.draft_tensor is not None:
                batch.draft_fill.append((start + n, req.draft_tensor))
            if req.prompt_logprobs is not None:
                # Rows at positions [lo, hi) predict prompt tokens lo+1 .. hi. Rows scored before a
                # preemption are not scored again when the prompt is recomputed.
                lo = max(done, req.num_prompt_logprob_rows)
                hi = min(done + n, req.num_prompt_tokens - 1)
                if lo < hi:
                    batch.prompt_jobs.append((req, start + lo - done, lo, hi))
        return batch

    def _score_prompts(self, batch: FlatBatch, hidden: torch.Tensor) -> list[tuple[Request, int, LogprobsTensors]]:
        jobs = []
        for req, row, lo, hi in batch.prompt_jobs:
            spec = row_spec(req, None)
            spec.position_independent = True
            k = req.params.prompt_logprobs
            targets = torch.tensor(req.prompt_token_ids[lo + 1 : hi + 1], dtype=torch.long, device=self.device)
            tensors = score_prompt_rows(
                self.model.compute_logits, hidden[row : row + hi - lo], targets, spec,
                self.vocab_size if k == -1 else k, self.vocab_size, self.config.prompt_logprobs_chunk_rows,
            )
            jobs.append((req, lo, tensors))
        return jobs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        if self.drafter is not None:
            self.drafter.draft(self, sched.scheduled)
        batch = self.build_batch(sched)
        if self.fault_tokens is not None and _contains_run(batch.input_ids, self.fault_tokens):
            raise RuntimeError(f"injected fault: tokens {self.fault_tokens} in the batch (VERISPEC_FAULT_INJECT_TOKENS)")
        dev = self.device
        meta = build_attention_metadata(batch.spans, self.pool.block_size, dev, self.model.dtype)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=dev)
        for row, drafts in batch.draft_fill:  # device-side drafts replace their placeholders
            input_ids[row : row + drafts.shape[0]] = drafts
        positions = torch.tensor(batch.positions, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, positions, meta, self.kv.layers)
        if self.drafter is not None:
            self.drafter.observe(self, input_ids, positions, meta)
        result = StepResult()
        prompt_jobs = self._score_prompts(batch, hidden)
        out = self._sample(batch, hidden) if batch.sample_rows else None

        # The step's single device-to-host transfer and synchronisation point.
        host = None
        if out is not None:
            host = (out.sampled.to("cpu", non_blocking=True), out.num_sampled.to("cpu", non_blocking=True),
                    out.logprobs.to_cpu_nonblocking() if out.logprobs is not None else None)
        prompt_host = [(req, lo, t.to_cpu_nonblocking()) for req, lo, t in prompt_jobs]
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()

        if host is not None:
            sampled, num_sampled, lp_host = host[0].tolist(), host[1].tolist(), host[2]
            lists = lp_host.tolists() if lp_host is not None else None
            for i, req in enumerate(batch.sample_reqs):
                n = num_sampled[i]
                result.sampled[req.request_id] = sampled[i][:n]
                if batch.drafts[i]:
                    result.num_accepted[req.request_id] = n - 1
                if lists is not None and i in out.lp_start:
                    start = out.lp_start[i]
                    result.logprobs[req.request_id] = LogprobsLists(
                        lists.logprob_token_ids[start : start + n], lists.logprobs[start : start + n],
                        lists.selected_token_ranks[start : start + n],
                    )
        for req, lo, t in prompt_host:
            result.prompt_logprobs[req.request_id] = (lo, t.tolists())
        return result

    def _sample(self, batch: FlatBatch, hidden: torch.Tensor) -> "SampleOutput":
        """Processes every sampled/verify row, then samples (no drafts) or verifies (drafts)."""
        dev = self.device
        rows: list[RowSpec] = []
        for req, spec in zip(batch.sample_reqs, batch.drafts):
            for j in range(len(spec) + 1):
                # Verify row j assumes drafts 1..j were accepted: penalties and min_tokens see them.
                rows.append(row_spec(req, "sample", spec[:j]))
        logits = self.model.compute_logits(hidden[torch.tensor(batch.sample_rows, device=dev)])
        md = SamplingMetadata.build(rows, self.vocab_size, dev)
        processed = apply_processors(logits, md)
        num_reqs = len(batch.sample_reqs)
        k = max(len(d) for d in batch.drafts)
        if k == 0:
            tokens = sample(processed, md)
            sampled, num_sampled, selected = tokens[:, None], torch.ones_like(tokens), tokens
        else:
            dest, padded_drafts = [], []
            for i, spec in enumerate(batch.drafts):
                dest.extend(i * (k + 1) + j for j in range(len(spec) + 1))
                padded_drafts.append(spec + [0] * (k - len(spec)))
            dest_t = torch.tensor(dest, dtype=torch.long, device=dev)
            drafts_t = torch.tensor(padded_drafts, dtype=torch.long, device=dev)
            for i, t in enumerate(batch.draft_tensors):
                if t is not None:
                    drafts_t[i, : t.shape[0]] = t
            # Padding rows hold zeros (a uniform row); verification never reads them.
            padded = processed.new_zeros(num_reqs * (k + 1), processed.shape[1]).index_copy_(0, dest_t, processed)
            greedy = [r.params.greedy for r in batch.sample_reqs]
            q = None
            if any(p is not None for p in batch.draft_probs):
                # Requests without drafts get zero q rows; verification masks them out.
                q = processed.new_zeros(num_reqs, k, processed.shape[1])
                for i, rows_q in enumerate(batch.draft_probs):
                    if rows_q is not None:
                        q[i, : rows_q.shape[0]] = rows_q
            out = verify(
                padded.view(num_reqs, k + 1, -1),
                drafts_t,
                [len(d) for d in batch.drafts],
                q,
                [p is not None for p in batch.draft_probs],
                [None if g else r.noise for g, r in zip(greedy, batch.sample_reqs)],
                [r.num_tokens for r in batch.sample_reqs],
            )
            sampled, num_sampled = out.sampled, out.num_sampled
            # Each row is scored at the token it emits (padding -1 -> 0; those rows are dropped).
            selected = sampled.reshape(-1)[dest_t].clamp_min(0)
        lp, order = score_rows(logits, processed, selected, rows, self.vocab_size)
        # Rows of one request are contiguous in `rows` and keep their order inside a mode group.
        lp_start: dict[int, int] = {}
        req_of_row = [i for i, spec in enumerate(batch.drafts) for _ in range(len(spec) + 1)]
        for pos, row in enumerate(order):
            lp_start.setdefault(req_of_row[row], pos)
        return SampleOutput(sampled, num_sampled, lp, lp_start)
