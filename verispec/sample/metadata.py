"""Per-step sampling metadata: one row per logits row that is sampled or scored.

Built once per step on the host from the requests' parameters (host values only), then moved to
the device in a handful of small tensors. Stage flags (`any_top_k`, ...) are host booleans derived
from parameters, never from device values, so skipping a stage costs no synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from verispec.config import LogprobsMode
from verispec.device_copy import to_device
from verispec.sample.noise import RequestNoise
from verispec.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's request imports the noise module, not this one
    from verispec.engine.request import Request


@dataclass(slots=True)
class RowSpec:
    """What one logits row needs: its request's parameters and token history."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # generated tokens before this row (includes accepted drafts)
    noise: RequestNoise | None  # None: the row is never sampled at random (greedy, scoring)
    stop_ids: frozenset[int]
    mode: LogprobsMode
    num_logprobs: int | None  # top-k count for this row's logprobs (None: no logprobs)
    position_independent: bool = False  # prompt rows: only position-independent processors
    purpose: str = "sample"  # which noise stream a random draw of this row uses

    @classmethod
    def for_request(cls, req: "Request", drafts: list[int] = (), purpose: str = "sample") -> "RowSpec":
        """The row that emits the token after req's tokens plus `drafts` (accepted, as far as
        this row knows: penalties and min_tokens see them)."""
        return cls(
            params=req.params,
            prompt_ids=req.prompt_token_ids,
            output_ids=req.output_token_ids + list(drafts),
            noise=req.noise,
            stop_ids=req.stop_ids,
            mode=req.logprobs_mode,
            num_logprobs=req.params.logprobs,
            purpose=purpose,
        )

    @property
    def position(self) -> int:
        """Sequence position of the token this row emits: its noise key."""
        return len(self.prompt_ids) + len(self.output_ids)

    def noise_key(self, purpose: str | None = None) -> int | None:
        """The key of this row's draw for `purpose` (default: the row's own); None for a row that
        never draws at random. The only place a row's noise key is made."""
        if self.noise is None or self.params.greedy:
            return None
        return self.noise.key(purpose or self.purpose, self.position)


@dataclass(slots=True)
class SamplingMetadata:
    rows: list[RowSpec]
    temperature: torch.Tensor  # [R] fp32, 1.0 for greedy rows
    top_k: torch.Tensor  # [R] int64, vocab size when off
    top_p: torch.Tensor  # [R] fp32
    min_p: torch.Tensor  # [R] fp32
    greedy: list[bool]
    any_temperature: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    any_sparse: bool  # allowed ids, bad words, min_tokens or logit_bias somewhere
    # A view (see `select`): logits row r belongs to `rows[row_index[r]]`, a device-side map.
    row_index: torch.Tensor | None = None
    # Tensors the processors build from `rows` once and share with every view of them.
    cache: dict = field(default_factory=dict)

    def select(self, row_index: torch.Tensor) -> "SamplingMetadata":
        """Metadata for logits rows picked from `rows` on the device (compact verification): the
        per-row tensors are gathered, host-built ones are gathered when a stage builds them."""
        return replace(
            self,
            temperature=self.temperature[row_index],
            top_k=self.top_k[row_index],
            top_p=self.top_p[row_index],
            min_p=self.min_p[row_index],
            row_index=row_index,
        )

    @classmethod
    def build(cls, rows: list[RowSpec], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        temps, ks, ps, mps, greedy = [], [], [], [], []
        any_pen = any_sparse = False
        for r in rows:
            p = r.params
            greedy.append(p.greedy)
            temps.append(1.0 if p.greedy else float(p.temperature))
            ks.append(min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size)  # above the vocabulary: off
            ps.append(float(p.top_p))
            mps.append(float(p.min_p))
            if not r.position_independent:
                any_pen |= p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                any_sparse |= bool(p._bad_words_token_ids or (p.min_tokens and len(r.output_ids) < p.min_tokens))
            any_sparse |= bool(p.allowed_token_ids or p.logit_bias)
        return cls(
            rows=rows,
            temperature=to_device(temps, dtype=torch.float32, device=device),
            top_k=to_device(ks, dtype=torch.long, device=device),
            top_p=to_device(ps, dtype=torch.float32, device=device),
            min_p=to_device(mps, dtype=torch.float32, device=device),
            greedy=greedy,
            any_temperature=any(t != 1.0 for t in temps),
            any_top_k=any(k < vocab_size for k in ks),
            any_top_p=any(p < 1.0 for p in ps),
            any_min_p=any(m > 0.0 for m in mps),
            any_penalty=any_pen,
            any_sparse=any_sparse,
        )
