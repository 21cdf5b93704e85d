"""The model runner: flat batch in, sampled tokens and logprobs out, with one D2H copy per step.

One step (docs/design.md, "One step"): a model drafter fills in the drafts the scheduler kept
(its adaptive plan, if any, rides in the `SchedulerOutput`); the host builds the flat batch and
the step's `SpecDecodeMetadata`; one forward; prompt rows are scored and every sampled row is
verified (zero drafts: plain sampling); then everything is copied to the host at once, with a
single synchronisation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from verispec.config import EngineConfig
from verispec.device_copy import to_device
from verispec.core.kv_cache import BlockPool
from verispec.core.step_types import ScheduledRequest, SchedulerOutput, StepResult
from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.models.cpu_kernels import share_cores
from verispec.models.llama import LlamaModel
from verispec.outputs import LogprobsTensors
from verispec.core.request import Request
from verispec.sample.prompt_logprobs import score_prompt_rows
from verispec.spec_decode.drafter import DraftInputs
from verispec.spec_decode.metadata import SpecDecodeMetadata
from verispec.spec_decode.verify import SampleOutput, verify


@dataclass(slots=True)
class PromptJob:
    """Prompt positions [lo, hi) of a request, at flat rows first_row.., predict tokens lo+1..hi."""

    request: Request
    first_row: int
    lo: int
    hi: int


@dataclass(slots=True)
class FlatBatch:
    input_ids: list[int] = field(default_factory=list)  # drafts a model drafter made are PLACEHOLDERs
    positions: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)
    sampled: list[ScheduledRequest] = field(default_factory=list)  # requests whose rows are sampled
    first_sample_rows: list[int] = field(default_factory=list)  # flat row of each one's first candidate row
    prompt_jobs: list[PromptJob] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig, pool: BlockPool, drafter=None):
        self.model = model
        self.config = config
        self.device = config.device
        self.pool = pool
        self.vocab_size = model.cfg.vocab_size
        self.kv = model.new_kv_cache(pool.num_blocks, pool.block_size)
        self.drafter = drafter  # a model-based drafter drafts inside the step, before the verify forward
        self.draft_inputs = DraftInputs(model, self.kv.layers, pool.table, pool.block_size, pool.num_blocks,
                                        self.vocab_size, self.device)
        spec = config.speculative
        self.max_verify_rows = spec.max_verify_rows_per_chunk if spec is not None else None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """The step's results. Reads `sched` and never changes it: running it again (the engine's
        crash isolation does) computes the same step."""
        if self.device.type == "cpu":
            share_cores()  # the cores the machine leaves this step (cores.py)
        began = time.perf_counter()
        drafts = self.drafter.draft(self.draft_inputs, sched.scheduled) if self.drafter is not None else {}
        # On a CPU the drafting's whole cost; on CUDA only its launches (the work runs on with the step).
        draft_seconds = time.perf_counter() - began if drafts else 0.0
        batch = self.build_batch(sched)
        verify_meta = None
        if batch.sampled:
            verify_meta = SpecDecodeMetadata.build(batch.sampled, batch.first_sample_rows, drafts, sched.plan,
                                                   self.vocab_size, self.device)
        hidden = self._forward(batch, verify_meta)
        prompt_jobs = self._score_prompts(batch, hidden)
        out = verify(self.model, hidden, verify_meta, self.max_verify_rows) if verify_meta is not None else None

        # The step's single device-to-host transfer and synchronisation point.
        host = out.to_cpu_nonblocking() if out is not None else None
        prompt_host = [(req, lo, t.to_cpu_nonblocking()) for req, lo, t in prompt_jobs]
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        result = self._step_result(verify_meta, host, prompt_host)
        result.draft_seconds = draft_seconds
        result.catch_up_seconds = self.drafter.catch_up_seconds if drafts else 0.0
        return result

    def build_batch(self, sched: SchedulerOutput) -> FlatBatch:
        batch = FlatBatch()
        for s in sched.scheduled:
            req, n, drafts = s.request, s.num_new_tokens, s.draft_token_ids
            start, done = len(batch.input_ids), req.num_computed_tokens
            total = n + len(drafts)
            batch.input_ids.extend(req.token_ids[done : done + n])
            batch.input_ids.extend(drafts)
            batch.positions.extend(range(done, done + total))
            batch.spans.append(SeqSpan(start, total, done + total, self.pool.table(req.request_id)))
            if s.samples:  # the last known token's row, then one row per draft
                batch.sampled.append(s)
                batch.first_sample_rows.append(start + n - 1)
            if req.scores_prompt:
                # Rows at positions [lo, hi) predict prompt tokens lo+1 .. hi. Rows scored before a
                # preemption are not scored again when the prompt is recomputed.
                lo = max(done, req.num_prompt_logprob_rows)
                hi = min(done + n, req.num_prompt_tokens - 1)
                if lo < hi:
                    batch.prompt_jobs.append(PromptJob(req, start + lo - done, lo, hi))
        return batch

    def _forward(self, batch: FlatBatch, verify_meta: SpecDecodeMetadata | None) -> torch.Tensor:
        dev = self.device
        meta = build_attention_metadata(batch.spans, self.pool.block_size, dev, self.model.dtype)
        input_ids = to_device(batch.input_ids, dtype=torch.long, device=dev)
        if verify_meta is not None:
            verify_meta.write_drafts(input_ids)
        positions = to_device(batch.positions, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, positions, meta, self.kv.layers)
        if self.drafter is not None:  # keeps the drafter's cache in step with the target's
            self.drafter.observe(self.draft_inputs, input_ids, positions, meta)
        return hidden

    def _score_prompts(self, batch: FlatBatch, hidden: torch.Tensor) -> list[tuple[Request, int, LogprobsTensors]]:
        jobs = []
        for job in batch.prompt_jobs:
            req, lo, hi = job.request, job.lo, job.hi
            if req.scored is not None:  # LLM.score: each row as the rollout's decode row
                rows = req.scored_rows(lo, hi)
            else:
                rows = replace(req.row(), noise=None, position_independent=True,
                               num_logprobs=req.params.prompt_logprobs)
            targets = to_device(req.prompt_token_ids[lo + 1 : hi + 1], dtype=torch.long, device=self.device)
            tensors = score_prompt_rows(self.model.compute_logits, hidden[job.first_row : job.first_row + hi - lo],
                                        targets, rows, self.vocab_size, self.config.prompt_logprobs_chunk_rows)
            jobs.append((req, lo, tensors))
        return jobs

    def _step_result(self, verify_meta: SpecDecodeMetadata | None, out: SampleOutput | None,
                     prompts: list[tuple[Request, int, LogprobsTensors]]) -> StepResult:
        """After the synchronisation: each request's tokens, logprob rows and drafts' outcome."""
        result = StepResult()
        for req, lo, t in prompts:
            result.of(req.request_id).prompt_logprobs = (lo, t.tolists())
        if out is None:
            return result
        sampled, num_sampled = out.sampled.tolist(), out.num_sampled.tolist()
        verified = out.num_verified.tolist() if out.num_verified is not None else verify_meta.num_draft_tokens
        confidence = out.draft_confidence.tolist() if out.draft_confidence is not None else None
        lists = out.logprobs.tolists() if out.logprobs is not None else None
        for i, req in enumerate(verify_meta.requests):
            record, n, d = result.of(req.request_id), num_sampled[i], verify_meta.num_draft_tokens[i]
            record.sampled = sampled[i][:n]
            if d:
                record.num_verified, record.num_accepted = verified[i], n - 1
                if confidence is not None:
                    record.draft_confidence = confidence[i][:d]
            if lists is not None and req.keeps_logprobs:
                record.logprobs = lists.slice_request(i, n)
        return result
