"""Self-speculative drafting: the target's first L layers, its final norm and its lm_head.

Drafting runs inside the step, after scheduling (so the draft positions have cache blocks) and
before the verify forward. Draft step j feeds each request's newest token through the first L
layers at its position, writing those layers' k/v into the target's own cache; the verify forward
then rewrites the same slots from the same inputs, so nothing needs rolling back. Drafts are drawn
from the request's own processor chain (same temperature, top-k, top-p) with its `draft` stream,
and q, the processed draft distribution, goes to verification.
"""

from __future__ import annotations

import torch

from verispec.config import SpeculativeConfig
from verispec.engine.request import Request
from verispec.models.attention import SeqSpan, build_attention_metadata
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.processors import apply_processors
from verispec.sample.sampler import sample


class LayerSkipDrafter:
    needs_forward = True  # drafts are made inside the step by `draft`, not by `propose`

    def __init__(self, cfg: SpeculativeConfig, num_target_layers: int):
        if cfg.num_layers > num_target_layers:
            raise ValueError(
                f"speculative_config.num_layers={cfg.num_layers} exceeds the target's {num_target_layers} layers"
            )
        self.k = cfg.num_speculative_tokens
        self.num_layers = cfg.num_layers

    def propose(self, running: list[Request], max_model_len: int) -> None:
        """Reserves draft slots (placeholders) so the scheduler can budget and allocate them."""
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1:
                continue
            room = min(req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens, self.k)
            if room > 0:
                req.spec_tokens = [0] * room

    @torch.inference_mode()
    def draft(self, runner, scheduled) -> None:
        """Replaces the placeholders of the scheduled requests with real drafts and their q rows."""
        from verispec.engine.runner import row_spec  # runner imports this module's users

        jobs = [s for s in scheduled if s.spec_tokens]
        if not jobs:
            return
        model, pool, dev = runner.model, runner.pool, runner.device
        drafts: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        last = torch.tensor([s.request.token_ids[s.request.num_computed_tokens] for s in jobs], device=dev)
        for j in range(max(len(s.spec_tokens) for s in jobs)):
            active = [i for i, s in enumerate(jobs) if len(s.spec_tokens) > j]
            spans, positions = [], []
            for row, i in enumerate(active):
                req = jobs[i].request
                pos = req.num_computed_tokens + j
                positions.append(pos)
                spans.append(SeqSpan(row, 1, pos + 1, pool.table(req.request_id)))
            meta = build_attention_metadata(spans, pool.block_size, dev, model.dtype)
            index = torch.tensor(active, dtype=torch.long, device=dev)
            hidden = model(last[index], torch.tensor(positions, device=dev), meta, runner.kv.layers, self.num_layers)
            logits = model.compute_logits(hidden)
            rows = [row_spec(jobs[i].request, jobs[i].request.streams.draft, drafts[i]) for i in active]
            md = SamplingMetadata.build(rows, runner.vocab_size, dev)
            processed = apply_processors(logits, md)
            tokens = sample(processed, md)
            q = processed.softmax(dim=-1)
            last = last.index_copy(0, index, tokens)
            # A host read per draft step: the next step's penalty histories (and the verify batch)
            # are host lists. On CUDA this is k extra syncs per step; see docs/design.md.
            for row, (i, tok) in enumerate(zip(active, tokens.tolist())):
                drafts[i].append(tok)
                probs[i].append(q[row])
        for s, d, q in zip(jobs, drafts, probs):
            s.spec_tokens = d
            s.request.draft_probs = torch.stack(q)
