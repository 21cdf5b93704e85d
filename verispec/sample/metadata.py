"""Per-step sampling metadata: one row per logits row that is sampled or scored.

Built once per step on the host from the requests' parameters (host values only), then moved to
the device in a handful of small tensors, one per stage that some row uses. Whether a stage runs
is decided from parameters on the host, never from device values, so skipping one costs no
synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
import torch

from verispec.config import LogprobsMode
from verispec.device_copy import to_device
from verispec.sample.grammar import bitmask_tensor
from verispec.sample.noise import RequestNoise
from verispec.sampling_params import SamplingParams


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
    grammar_mask: bytes | None = None  # structured output: llguidance's bitmask for this row
    purpose: str = "sample"  # which noise stream a random draw of this row uses
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # the request's, tokenized
    # The values of output_ids' last entries where only the device knows them (a model's drafts,
    # placeholders on the host): penalties and bad words read them there, with no sync.
    device_tail: torch.Tensor | None = None

    def host_output_ids(self) -> list[int]:
        """output_ids without the device tail: the values the host knows."""
        n = 0 if self.device_tail is None else self.device_tail.shape[0]
        return self.output_ids[: len(self.output_ids) - n]

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
    # Per-row stage inputs; None where no row uses the stage (it is skipped, and costs no copy).
    temperature: torch.Tensor | None  # [R] fp32, 1.0 for greedy rows
    top_k: torch.Tensor | None  # [R] int64, vocab size when off
    top_p: torch.Tensor | None  # [R] fp32
    min_p: torch.Tensor | None  # [R] fp32
    greedy: list[bool]
    any_penalty: bool
    any_sparse: bool  # allowed ids, bad words, min_tokens or logit_bias somewhere
    grammar: torch.Tensor | None  # the rows' allowed tokens, bool or packed bits (sample/grammar.py)
    # A view (see `select`): logits row r belongs to `rows[row_index[r]]`, a device-side map.
    row_index: torch.Tensor | None = None
    # Tensors the processors build from `rows` once and share with every view of them.
    cache: dict = field(default_factory=dict)

    def select(self, row_index: torch.Tensor) -> "SamplingMetadata":
        """Metadata for logits rows picked from `rows` on the device (compact verification): the
        per-row tensors are gathered, host-built ones are gathered when a stage builds them."""
        pick = lambda t: None if t is None else t[row_index]  # noqa: E731
        return replace(self, temperature=pick(self.temperature), top_k=pick(self.top_k), top_p=pick(self.top_p),
                       min_p=pick(self.min_p), grammar=pick(self.grammar), row_index=row_index)

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
                any_sparse |= bool(r.bad_words_token_ids or (p.min_tokens and len(r.output_ids) < p.min_tokens))
            any_sparse |= bool(p.allowed_token_ids or p.logit_bias)

        def stage(values: list, used: bool, dtype: torch.dtype) -> torch.Tensor | None:
            return to_device(values, dtype=dtype, device=device) if used else None

        return cls(
            rows=rows,
            temperature=stage(temps, any(t != 1.0 for t in temps), torch.float32),
            top_k=stage(ks, any(k < vocab_size for k in ks), torch.long),
            top_p=stage(ps, any(p < 1.0 for p in ps), torch.float32),
            min_p=stage(mps, any(m > 0.0 for m in mps), torch.float32),
            greedy=greedy,
            any_penalty=any_pen,
            any_sparse=any_sparse,
            grammar=bitmask_tensor([r.grammar_mask for r in rows], vocab_size, device),
        )
