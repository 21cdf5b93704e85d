"""The model runner: flat batch in, sampled tokens and logprobs out, with one D2H copy per step.

Steps (docs/design.md, "One step"): build the flat batch and the attention metadata on the host, run one
forward, compute logits only for the rows that are sampled, process them per request, sample,
score logprobs in each request's own mode, then copy everything to the host at once and
synchronise a single time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from verispec.config import EngineConfig, LogprobsMode
from verispec.device_copy import to_device
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
from verispec.spec_decode.verify_batch import VerifyRequest, verify_batch


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
    # Per speculating request: how many of its drafts were verified, and how many accepted.
    num_verified: dict[str, int] = field(default_factory=dict)
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
    # Request index -> its first row in `logprobs` (host layout); None: verification, whose rows
    # are sliced by the device boundaries that come back with the copy.
    lp_start: dict[int, int] | None
    capacities: torch.Tensor | None = None  # [R] drafts verified per request (verification)
    confidence: torch.Tensor | None = None  # [R, K] model drafters' q peaks (adaptive)


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
        index = to_device(idx, dtype=torch.long, device=raw.device)
        source = (raw if mode.is_raw else processed)[index]
        custom_ids = None
        k = 0
        if custom:
            lists = [rows[i].params.logprob_token_ids for i in idx]
            width = max(len(x) for x in lists)
            custom_ids = to_device([x + x[:1] * (width - len(x)) for x in lists], device=raw.device)
        else:
            ks = [rows[i].num_logprobs for i in idx]
            k = vocab if -1 in ks else max(ks)
        chunks.append(compute_topk_scores(source, k, selected[index], custom_ids, mode.is_logprobs))
        order.extend(idx)
    return LogprobsTensors.cat(chunks), order


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig, pool: BlockPool, drafter=None, adaptive=None):
        self.model = model
        self.config = config
        self.device = config.device
        self.pool = pool
        self.vocab_size = model.cfg.vocab_size
        self.kv = KVCacheTensors(model.cfg, pool.num_blocks, pool.block_size, model.dtype, self.device)
        self.drafter = drafter  # a model-based drafter drafts inside the step, before the verify forward
        self.adaptive = adaptive  # AdaptiveController when speculative_config["adaptive_verification"]
        spec = config.speculative
        self.max_verify_rows = spec.max_verify_rows_per_chunk if spec is not None else None
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
            targets = to_device(req.prompt_token_ids[lo + 1 : hi + 1], dtype=torch.long, device=self.device)
            tensors = score_prompt_rows(
                self.model.compute_logits, hidden[row : row + hi - lo], targets, spec,
                self.vocab_size if k == -1 else k, self.vocab_size, self.config.prompt_logprobs_chunk_rows,
            )
            jobs.append((req, lo, tensors))
        return jobs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        budget = None
        if self.adaptive is not None and any(s.spec_tokens for s in sched.scheduled):
            budget = self.adaptive.plan(sched.scheduled)  # host values only; trims the drafts
        if self.drafter is not None:
            self.drafter.draft(self, sched.scheduled)
        batch = self.build_batch(sched)
        if self.fault_tokens is not None and _contains_run(batch.input_ids, self.fault_tokens):
            raise RuntimeError(f"injected fault: tokens {self.fault_tokens} in the batch (VERISPEC_FAULT_INJECT_TOKENS)")
        dev = self.device
        meta = build_attention_metadata(batch.spans, self.pool.block_size, dev, self.model.dtype)
        input_ids = to_device(batch.input_ids, dtype=torch.long, device=dev)
        for row, drafts in batch.draft_fill:  # device-side drafts replace their placeholders
            input_ids[row : row + drafts.shape[0]] = drafts
        positions = to_device(batch.positions, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, positions, meta, self.kv.layers)
        if self.drafter is not None:
            self.drafter.observe(self, input_ids, positions, meta)
        result = StepResult()
        prompt_jobs = self._score_prompts(batch, hidden)
        out = self._sample(batch, hidden, budget) if batch.sample_rows else None

        # The step's single device-to-host transfer and synchronisation point.
        host = None
        if out is not None:
            move = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
            host = (move(out.sampled), move(out.num_sampled), move(out.capacities), move(out.confidence),
                    out.logprobs.to_cpu_nonblocking() if out.logprobs is not None else None)
        prompt_host = [(req, lo, t.to_cpu_nonblocking()) for req, lo, t in prompt_jobs]
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()

        if host is not None:
            self._read_samples(batch, out, host, result)
        for req, lo, t in prompt_host:
            result.prompt_logprobs[req.request_id] = (lo, t.tolists())
        return result

    def _read_samples(self, batch: FlatBatch, out: SampleOutput, host: tuple, result: StepResult) -> None:
        """After the synchronisation: each request's tokens, logprob rows and draft outcome."""
        sampled, num_sampled = host[0].tolist(), host[1].tolist()
        capacities = host[2].tolist() if host[2] is not None else None
        confidence = host[3].tolist() if host[3] is not None else None
        lists = host[4].tolists() if host[4] is not None else None
        for i, req in enumerate(batch.sample_reqs):
            n = num_sampled[i]
            rid = req.request_id
            result.sampled[rid] = sampled[i][:n]
            if batch.drafts[i]:
                result.num_accepted[rid] = n - 1
                result.num_verified[rid] = capacities[i]
                if self.adaptive is not None:
                    q = confidence[i][: len(batch.drafts[i])] if confidence is not None else None
                    self.adaptive.observe(req, capacities[i], n - 1, q)
            if lists is None:
                continue
            if out.lp_start is None:
                if req.logprobs is not None:  # the request keeps logprobs
                    result.logprobs[rid] = lists.slice_request(i, n)
            elif i in out.lp_start:
                start = out.lp_start[i]
                result.logprobs[rid] = LogprobsLists(
                    lists.logprob_token_ids[start : start + n], lists.logprobs[start : start + n],
                    lists.selected_token_ranks[start : start + n],
                )

    def _sample(self, batch: FlatBatch, hidden: torch.Tensor, budget: int | None = None) -> "SampleOutput":
        """Samples the rows of a step without drafts; a step with drafts goes to verification."""
        if any(batch.drafts):
            return self._verify(batch, hidden, budget)
        dev = self.device
        rows = [row_spec(req, "sample") for req in batch.sample_reqs]
        logits = self.model.compute_logits(hidden[to_device(batch.sample_rows, device=dev)])
        md = SamplingMetadata.build(rows, self.vocab_size, dev)
        processed = apply_processors(logits, md)
        tokens = sample(processed, md)
        lp, order = score_rows(logits, processed, tokens, rows, self.vocab_size)
        return SampleOutput(tokens[:, None], torch.ones_like(tokens), lp, {req: pos for pos, req in enumerate(order)})

    def _verify(self, batch: FlatBatch, hidden: torch.Tensor, budget: int | None) -> "SampleOutput":
        reqs, row = [], 0
        for req, spec, q, t in zip(batch.sample_reqs, batch.drafts, batch.draft_probs, batch.draft_tensors):
            # Row j assumes drafts 1..j were accepted: penalties and min_tokens see them.
            rows = [row_spec(req, "sample", spec[:j]) for j in range(len(spec) + 1)]
            host_scores = None
            if self.adaptive is not None and self.drafter is None and spec:
                host_scores = self.adaptive.host_scores(req, len(spec))
            reqs.append(VerifyRequest(
                rows=rows, first_flat_row=batch.sample_rows[row], host_drafts=list(spec),
                device_drafts=t, q=q, confidence=req.draft_conf if spec else None, host_scores=host_scores,
            ))
            row += len(spec) + 1
        calibration = None
        if self.adaptive is not None and self.drafter is not None:
            calibration = self.adaptive.calibration_tensors(self.device)
        out = verify_batch(self.model, hidden, reqs, self.vocab_size, budget, self.max_verify_rows, calibration)
        return SampleOutput(out.sampled, out.num_sampled, out.logprobs, None, out.capacities, out.confidence)
