"""The logits processor chain, in the order of DESIGN.md section 4:

1. allowed_token_ids mask   2. bad words   3. min_tokens (stop ids masked)   4. logit_bias
5. repetition / presence / frequency penalties   6. temperature (1 for greedy)   7. min_p
8. top_k / top_p (masked entries become -inf)

Rows flagged `position_independent` (prompt positions) get only 1, 4, 6, 7 and 8. The stages that
need per-request token lists (1-5) build their masks on the host from host data; 6-8 are batched.
"""

from __future__ import annotations

import torch

from verispec.sample.metadata import SamplingMetadata

NEG_INF = float("-inf")


def apply_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Returns processed fp32 logits [R, V]; `logits` itself is left untouched (raw snapshot)."""
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    if md.any_sparse:
        _apply_sparse(out, md)
    if md.any_penalty:
        _apply_penalties(out, md)
    if md.any_temperature:
        out.div_(md.temperature[:, None])
    if md.any_min_p:
        _apply_min_p(out, md.min_p)
    if md.any_top_k or md.any_top_p:
        out = apply_top_k_top_p(out, md.top_k if md.any_top_k else None, md.top_p if md.any_top_p else None)
    return out


def _apply_sparse(out: torch.Tensor, md: SamplingMetadata) -> None:
    vocab = out.shape[1]
    for i, row in enumerate(md.rows):
        p = row.params
        if p.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool, device=out.device)
            keep[torch.tensor(p.allowed_token_ids, device=out.device)] = True
            out[i].masked_fill_(~keep, NEG_INF)
        if not row.position_independent:
            banned = _banned_by_bad_words(p._bad_words_token_ids, row.output_ids)
            if p.min_tokens and len(row.output_ids) < p.min_tokens:
                banned.extend(row.stop_ids)
            if banned:
                out[i, torch.tensor(banned, dtype=torch.long, device=out.device)] = NEG_INF
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=out.device)
            vals = torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=out.device)
            out[i].index_add_(0, ids, vals)


def _banned_by_bad_words(bad_words: list[list[int]], output_ids: list[int]) -> list[int]:
    """A bad word's last token is banned when the output already ends with the rest of it."""
    banned = []
    for seq in bad_words:
        prefix = seq[:-1]
        if not prefix or output_ids[-len(prefix) :] == prefix:
            banned.append(seq[-1])
    return banned


def _apply_penalties(out: torch.Tensor, md: SamplingMetadata) -> None:
    rows, vocab, device = len(md.rows), out.shape[1], out.device
    rep = torch.ones(rows, device=device)
    pres = torch.zeros(rows, device=device)
    freq = torch.zeros(rows, device=device)
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device)  # +1: padding column
    counts = torch.zeros(rows, vocab + 1, device=device)
    for i, row in enumerate(md.rows):
        p = row.params
        if row.position_independent:
            continue
        rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        if row.output_ids:
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(ids), device=device))
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(row.prompt_ids + row.output_ids, dtype=torch.long, device=device)
            seen[i, ids] = True
    seen, counts = seen[:, :vocab], counts[:, :vocab]
    seen |= counts > 0
    # Repetition (prompt + output): shrink positive logits, grow negative ones, by the penalty.
    penalised = torch.where(out > 0, out / rep[:, None], out * rep[:, None])
    out.copy_(torch.where(seen, penalised, out))
    # Presence / frequency (output only), OpenAI's definition.
    out.sub_(freq[:, None] * counts + pres[:, None] * (counts > 0).float())


def _apply_min_p(out: torch.Tensor, min_p: torch.Tensor) -> None:
    probs = out.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    out.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k_top_p(out: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks to the top-k entries, then to the smallest set whose mass reaches top_p.

    Ties at the k-th value are kept (a threshold, as HF's TopKLogitsWarper does); the most likely
    token always survives top_p.
    """
    sorted_logits, order = out.sort(dim=-1)  # ascending
    vocab = out.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab))[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False
        # Rows with top_p off must not lose the tokens whose fp32 mass rounds to zero.
        drop &= (top_p < 1.0)[:, None]
        sorted_logits.masked_fill_(drop, NEG_INF)
    return torch.empty_like(out).scatter_(1, order, sorted_logits)
