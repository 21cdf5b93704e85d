"""DSpark and DFlash drafting: one forward of a small block drafter per step reads the target's own
hidden states and drafts a whole block (the network: models/dspark.py).

- The target's forward returns the outputs of the drafter's `target_layer_ids` beside its hidden
  states (`LlamaModel.capture_layers`, compiled into its graph: no second pass). After every
  target forward (`observe`), their context keys and values go into the drafter's own paged cache,
  one slot per position in the target's blocks: freed, preempted and prefix-cached with them.
  Rows of rejected drafts are written too, and lie past the request's computed tokens until the
  target overwrites them, so no draft ever reads them. On a CPU the writes wait for the next draft
  (`_flush`), all at once: each write is a dozen small ops (0.9 ms of a 14 ms step at batch 1),
  and while adaptive verification refuses drafts most steps never draft. A slot written twice
  meanwhile (a rejected draft's row, a block freed and reused) keeps its latest write.
- While drafting (`draft`), each request's block [its pending token, masks] at positions
  num_computed .. + B - 1 attends to its context, positions [0, num_computed), and to itself.
- Drafts are then drawn slot by slot, because the Markov head's bias at a slot depends on the draft
  before it: greedy requests take the argmax, random ones sample from the request's own processed
  distribution (temperature, top-k, top-p), which is q for the rejection rule.
- The confidence head's chance of acceptance is each slot's confidence for adaptive verification.
  It reads the slot's hidden state and the previous draft, never the slot's own draft, so which
  drafts get verified does not lean on their values (docs/adaptive.md). Without a confidence head
  (DFlash) the confidence is q's peak, as for the other model drafters.
"""

from __future__ import annotations

import time

import torch

from verispec.config import EngineConfig, SpeculativeConfig
from verispec.device_copy import to_device
from verispec.models.dspark import DSparkModel, target_head_rows
from verispec.models.dspark_checkpoint import check_against_target, read_dspark_checkpoint
from verispec.models.default import default_drafter_path
from verispec.models.llama import LlamaModel
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.processors import apply_processors
from verispec.sample.sampler import sample
from verispec.spec_decode.drafter import DraftInputs, ModelDrafter, device_tail, needs_token_values
from verispec.spec_decode.metadata import PLACEHOLDER, ModelDrafts

# Context writes a CPU keeps pending at most (tokens): 4096 x 5 layers x 576 x 2 bytes is 24 MB for
# SmolLM2-135M; a long prefill with no draft after it is written in parts.
PENDING_TOKENS = 4096
# A forward of at least this many rows is a prefill chunk (a step's decode rows are one per request
# and its drafts): its context is written at once.
PREFILL_ROWS = 64


class DSparkDrafter(ModelDrafter):
    def __init__(self, cfg: SpeculativeConfig, target: LlamaModel, engine_config: EngineConfig, tp=None):
        if tp is not None:
            raise ValueError(f"speculative_config.method {cfg.method!r} does not run under tensor parallelism")
        path = cfg.model or default_drafter_path()
        dcfg, tensors = read_dspark_checkpoint(path)
        try:
            check_against_target(dcfg, tensors, target.cfg)
        except ValueError as exc:
            if cfg.model:
                raise
            raise ValueError(f"the DSpark drafter verispec ships is for SmolLM2-135M-Instruct ({exc}); give "
                             "speculative_config.model, a drafter made for this target (verispec train-drafter)") from None
        if cfg.method == "dspark" and not dcfg.is_dspark:
            raise ValueError("speculative_config.model has neither a Markov nor a confidence head: it is a DFlash "
                             "checkpoint (method 'dflash')")
        if cfg.method == "dflash" and dcfg.is_dspark:
            raise ValueError("speculative_config.model has DSpark's heads (Markov, confidence): use method 'dspark'")
        if cfg.num_speculative_tokens is None:
            cfg.num_speculative_tokens = dcfg.max_drafts
        elif cfg.num_speculative_tokens > dcfg.max_drafts:
            raise ValueError(f"speculative_config.num_speculative_tokens={cfg.num_speculative_tokens} exceeds the "
                             f"{dcfg.max_drafts} drafts this drafter's block of {dcfg.block_size} gives")
        self.cfg = dcfg
        self.model = DSparkModel(dcfg, tensors, target.cfg.vocab_size, target.dtype, engine_config.device,
                                 head_rows=lambda ids: target_head_rows(target)[ids])
        # Its confidences are the head's acceptance chances, not q peaks: calibrated from the start.
        self.calibrated = dcfg.confidence_head
        target.capture_layers = dcfg.target_layer_ids  # before the target's graph is compiled
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (features, positions, slots)
        self._pending_tokens = 0

    def _cache(self, inputs: DraftInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, context keys and values [num_blocks, block_size, kv heads, head dim]."""
        if self.cache is None:
            lay = self.model.layers[0]
            shape = (inputs.num_blocks, inputs.block_size, lay.num_kv_heads, lay.head_dim)
            new = lambda: torch.zeros(shape, dtype=self.model.dtype, device=inputs.device)  # noqa: E731
            self.cache = [(new(), new()) for _ in self.model.layers]
        return self.cache

    @torch.inference_mode()
    def observe(self, inputs: DraftInputs, input_ids, positions, meta) -> None:
        features, inputs.target.captured = inputs.target.captured, None
        self._pending.append((features, positions, meta.slot_mapping))
        self._pending_tokens += features.shape[0]
        # On CUDA the captured outputs may be a graph's static buffers, rewritten by the next step.
        # A prefill chunk's writes go in at once, a small share of its forward: left pending, a
        # 630-token prompt's became the first draft's catch-up, and that paused the probes.
        if inputs.device.type != "cpu" or self._pending_tokens >= PENDING_TOKENS or features.shape[0] >= PREFILL_ROWS:
            self._flush(inputs)

    def _flush(self, inputs: DraftInputs) -> None:
        """The pending context writes into the cache, each slot's latest."""
        if not self._pending:
            return
        if len(self._pending) == 1:  # every step on CUDA: written as captured, no copy
            (features, positions, slots), = self._pending
        else:
            features, positions, slots = (torch.cat(x) for x in zip(*self._pending))
            slots, rows = latest_writes(slots)
            features, positions = features[rows], positions[rows]
        self._pending, self._pending_tokens = [], 0
        for (k_cache, v_cache), (k, v) in zip(self._cache(inputs), self.model.context_kv(features, positions)):
            k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
            v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    @torch.inference_mode()
    def draft(self, inputs: DraftInputs, scheduled) -> dict[str, ModelDrafts]:
        jobs = [s for s in scheduled if s.drafts]
        self.catch_up_seconds = 0.0
        if not jobs:
            return {}
        began = time.perf_counter()
        self._flush(inputs)
        self.catch_up_seconds = time.perf_counter() - began
        hidden, anchors = self._blocks(inputs, [s.request for s in jobs])
        first, k = self.cfg.first_slot, max(len(s.draft_token_ids) for s in jobs)
        slots = hidden[:, first : first + k]  # [R, K, hidden]: slot j drafts the j-th token
        base = self.model.logits(slots.reshape(-1, slots.shape[-1]), inputs.target.compute_logits)
        base = base.view(len(jobs), k, -1)
        if all(_raw_argmax(s.request) for s in jobs):
            return self._argmax_chain(jobs, slots, base, anchors)
        return self._draw(inputs, jobs, slots, base, anchors)

    def _argmax_chain(self, jobs, slots: torch.Tensor, base: torch.Tensor, anchors: torch.Tensor) -> dict[str, ModelDrafts]:
        """Every request greedy, with no processor that can move its argmax: each slot's draft is
        the argmax of its logits and the Markov bias, in the draft vocabulary; no q (greedy
        verification compares argmaxes), a few small ops per slot."""
        tokens, chances, prev = [], [], anchors
        for j in range(base.shape[1]):
            logits = base[:, j]
            bias = self.model.markov_bias(prev)
            if bias is not None:
                logits = logits + bias
            chance = self.model.accept_chance(slots[:, j], prev)
            chances.append(chance if chance is not None else logits.softmax(dim=-1).amax(dim=-1))
            best = logits.argmax(dim=-1)
            prev = best if self.model.d2t is None else self.model.d2t[best]
            tokens.append(prev)
        ids, conf = torch.stack(tokens, dim=1), torch.stack(chances, dim=1)
        return {s.request.request_id: ModelDrafts(token_ids=ids[i, :n], probs=None, confidence=conf[i, :n])
                for i, (s, n) in enumerate((s, len(s.draft_token_ids)) for s in jobs)}

    def _blocks(self, inputs: DraftInputs, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's block through the drafter: hidden states [R, B, hidden] and the anchors [R]."""
        dev, b, bs = inputs.device, self.cfg.block_size, inputs.block_size
        starts = [r.num_computed_tokens for r in reqs]
        anchors = [r.token_ids[c] for r, c in zip(reqs, starts)]
        ids = [t for a in anchors for t in [a] + [self.cfg.mask_token_id] * (b - 1)]
        width = max(-(-c // bs) for c in starts)
        tables = [t for r, c in zip(reqs, starts) for t in _padded(inputs.block_table(r.request_id), -(-c // bs), width)]
        tables_t = to_device(tables, dtype=torch.long, device=dev).view(len(reqs), width)
        starts_t = to_device(starts, dtype=torch.long, device=dev)
        positions = (starts_t[:, None] + torch.arange(b, device=dev)[None, :]).reshape(-1)
        # Context slots [0, start) are visible, the rest of the gathered blocks not; the block all.
        seen = torch.arange(width * bs, device=dev)[None, :] < starts_t[:, None]
        seen = torch.cat([seen, seen.new_ones(len(reqs), b)], dim=1)
        mask = torch.zeros(seen.shape, dtype=self.model.dtype, device=dev).masked_fill_(~seen, float("-inf"))
        context = [(k[tables_t].flatten(1, 2), v[tables_t].flatten(1, 2)) for k, v in self._cache(inputs)]
        ids_t = to_device(ids, dtype=torch.long, device=dev)
        hidden = self.model.block(inputs.target.embed_tokens(ids_t), positions, context, mask[:, None, None, :])
        return hidden.view(len(reqs), b, -1), ids_t.view(len(reqs), b)[:, 0]

    def _draw(self, inputs: DraftInputs, jobs, slots: torch.Tensor, base: torch.Tensor,
              anchors: torch.Tensor) -> dict[str, ModelDrafts]:
        """Draws each slot's draft after the one before it (the Markov head chains them)."""
        n = len(jobs)
        drafts: list[list[int]] = [[] for _ in jobs]
        out: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in jobs]
        prev = anchors
        for j in range(base.shape[1]):
            active = [i for i, s in enumerate(jobs) if len(s.draft_token_ids) > j]
            index = None if len(active) == n else to_device(active, dtype=torch.long, device=inputs.device)
            pick = (lambda t: t) if index is None else (lambda t: t.index_select(0, index))  # noqa: E731
            logits = base[:, j]
            bias = self.model.markov_bias(prev)
            if bias is not None:
                logits = logits + bias
            full = self.model.to_target_vocab(pick(logits), inputs.vocab_size)
            rows = [jobs[i].request.row(drafts[i], purpose="draft",
                                        device_tail=device_tail(jobs[i].request, [t for t, _, _ in out[i]]))
                    for i in active]
            md = SamplingMetadata.build(rows, inputs.vocab_size, inputs.device)
            processed = apply_processors(full, md)
            tokens = sample(processed, md)
            q = processed.softmax(dim=-1)
            chance = self.model.accept_chance(pick(slots[:, j]), pick(prev))
            conf = chance if chance is not None else q.amax(dim=-1)
            prev = tokens if index is None else prev.index_copy(0, index, tokens)
            for row, i in enumerate(active):
                drafts[i].append(PLACEHOLDER)
                out[i].append((tokens[row], q[row], conf[row]))
        return {s.request.request_id: ModelDrafts(token_ids=torch.stack([t for t, _, _ in o]),
                                                  probs=torch.stack([p for _, p, _ in o]),
                                                  confidence=torch.stack([c for _, _, c in o]))
                for s, o in zip(jobs, out)}


def _raw_argmax(req) -> bool:
    """A greedy request whose processors cannot move the argmax (no penalties, bad words, bias,
    allowed ids or minimum length): its draft is the raw logits' argmax."""
    p = req.params
    return p.greedy and not (needs_token_values(req) or p.min_tokens or p.logit_bias or p.allowed_token_ids)


def latest_writes(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct slots of a run of writes, and for each the index of its last write (index_copy_
    with repeated indices keeps an arbitrary one)."""
    unique, inverse = torch.unique(slots, return_inverse=True)
    order = torch.arange(len(slots), device=slots.device)
    last = torch.zeros(len(unique), dtype=torch.long, device=slots.device).scatter_reduce_(0, inverse, order, "amax")
    return unique, last


def _padded(table: list[int], n: int, width: int) -> list[int]:
    """A request's first n blocks, padded with block 0 (masked, never read) to `width`."""
    return table[:n] + [0] * (width - n)
