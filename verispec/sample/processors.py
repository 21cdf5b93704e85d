"""The logits processor chain, in this order (HF transformers applies the same stages alike):

0. grammar mask (structured output)
1. allowed_token_ids mask   2. bad words   3. min_tokens (stop ids masked)   4. logit_bias
5. repetition / presence / frequency penalties   6. temperature (1 for greedy)   7. min_p
8. top_k / top_p (masked entries become -inf)

Rows flagged `position_independent` (prompt positions) get only 1, 4, 6, 7 and 8 (a prompt has no
grammar). The stages that
need per-request token lists (1-5) build their masks on the host from host data; 6-8 are batched.
"""

from __future__ import annotations

import torch

from verispec.device_copy import to_device
from verispec.sample.grammar import apply_bitmask
from verispec.sample.metadata import RowSpec, SamplingMetadata

NEG_INF = float("-inf")


def apply_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Returns processed fp32 logits [R, V]; `logits` itself is left untouched (raw snapshot)."""
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    if md.grammar is not None:
        apply_bitmask(out, md.grammar)
    if md.any_sparse:
        _apply_sparse(out, md)
    if md.any_penalty:
        _apply_penalties(out, md)
    if md.temperature is not None:
        out.div_(md.temperature[:, None])
    if md.min_p is not None:
        _apply_min_p(out, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        out = apply_top_k_top_p(out, md.top_k, md.top_p)
    return out


def _sparse_entries(md: SamplingMetadata, device: torch.device) -> dict[str, torch.Tensor]:
    """Host-built per-row edits as (row, column[, value]) lists over `md.rows`, built once."""
    if "sparse" in md.cache:
        return md.cache["sparse"]
    allow_rows, allow_cols, ban_rows, ban_cols, bias_rows, bias_cols, bias_vals = [], [], [], [], [], [], []
    has_allow, maybe_rows, maybe_cols, maybe_conds = [], [], [], []
    for i, row in enumerate(md.rows):
        p = row.params
        has_allow.append(bool(p.allowed_token_ids))
        if p.allowed_token_ids:
            allow_rows.extend([i] * len(p.allowed_token_ids))
            allow_cols.extend(p.allowed_token_ids)
        if not row.position_independent:
            banned, maybe = _banned_by_bad_words(row, device)
            if p.min_tokens and len(row.output_ids) < p.min_tokens:
                banned.extend(row.stop_ids)
            ban_rows.extend([i] * len(banned))
            ban_cols.extend(banned)
            for col, cond in maybe:
                maybe_rows.append(i)
                maybe_cols.append(col)
                maybe_conds.append(cond)
        if p.logit_bias:
            bias_rows.extend([i] * len(p.logit_bias))
            bias_cols.extend(p.logit_bias.keys())
            bias_vals.extend(p.logit_bias.values())
    long = lambda x: to_device(x, dtype=torch.long, device=device)  # noqa: E731
    # A ban the device decides becomes an added -inf or 0: duplicates add up, in any order.
    maybe_vals = (torch.where(torch.stack(maybe_conds), NEG_INF, 0.0) if maybe_conds
                  else torch.zeros(0, device=device))
    md.cache["sparse"] = entries = {
        "has_allow": to_device(has_allow, dtype=torch.bool, device=device),
        "allow": (long(allow_rows), long(allow_cols)),
        "ban": (long(ban_rows), long(ban_cols)),
        "maybe_ban": (long(maybe_rows), long(maybe_cols), maybe_vals),
        "bias": (long(bias_rows), long(bias_cols), to_device(bias_vals, dtype=torch.float32, device=device)),
    }
    return entries


def _apply_sparse(out: torch.Tensor, md: SamplingMetadata) -> None:
    """Allowed ids, bad words, min_tokens and logit_bias. On a view (md.row_index), rows of `rows`
    that are not in the view are sent to a scratch row: the map lives on the device."""
    e = _sparse_entries(md, out.device)
    n, vocab = out.shape
    has_allow = e["has_allow"]
    target = out
    if md.row_index is None:
        place = lambda rows: rows  # noqa: E731
    else:
        has_allow = has_allow[md.row_index]
        where = torch.full((len(md.rows),), n, dtype=torch.long, device=out.device)
        where.index_copy_(0, md.row_index, torch.arange(n, device=out.device))
        place = lambda rows: where[rows]  # noqa: E731
        target = torch.cat([out, out.new_zeros(1, vocab)])
    rows, cols = e["allow"]
    if rows.numel():
        keep = torch.zeros(target.shape, dtype=torch.bool, device=out.device)
        keep.index_put_((place(rows), cols), torch.ones_like(cols, dtype=torch.bool))
        target[:n].masked_fill_(~keep[:n] & has_allow[:, None], NEG_INF)
    rows, cols = e["ban"]
    if rows.numel():
        target.index_put_((place(rows), cols), torch.full(cols.shape, NEG_INF, dtype=target.dtype, device=out.device))
    for key in ("maybe_ban", "bias"):
        rows, cols, vals = e[key]
        if rows.numel():
            target.index_put_((place(rows), cols), vals.to(target.dtype), accumulate=True)
    if target is not out:
        out.copy_(target[:n])


def _banned_by_bad_words(row: RowSpec, device: torch.device) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
    """A bad word's last token is banned when the output already ends with the rest of it. Where
    that ending reaches into the device tail, the device decides: (token, condition) pairs."""
    banned, maybe = [], []
    out = row.output_ids
    known = len(row.host_output_ids())
    for seq in row.bad_words_token_ids:
        prefix = seq[:-1]
        if len(prefix) > len(out):
            continue
        on_device = min(len(prefix), len(out) - known)  # the prefix's last entries the device holds
        if out[len(out) - len(prefix) : len(out) - on_device] != prefix[: len(prefix) - on_device]:
            continue
        if not on_device:
            banned.append(seq[-1])
        else:
            want = to_device(prefix[-on_device:], dtype=torch.long, device=device)
            maybe.append((seq[-1], (row.device_tail[-on_device:] == want).all()))
    return banned, maybe


def _penalty_tensors(md: SamplingMetadata, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per row of `md.rows`: the three penalties, seen-token mask and output counts, built once."""
    if "penalty" in md.cache:
        return md.cache["penalty"]
    rows = len(md.rows)
    rep = torch.ones(rows, device=device)
    pres = torch.zeros(rows, device=device)
    freq = torch.zeros(rows, device=device)
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device)  # +1: padding column
    counts = torch.zeros(rows, vocab + 1, device=device)
    for i, row in enumerate(md.rows):
        p = row.params
        if row.position_independent or (p.repetition_penalty == 1.0 and not p.presence_penalty
                                        and not p.frequency_penalty):
            continue  # nothing to apply; its drafts may be placeholders, never read
        rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        host = row.host_output_ids()
        ids = to_device(host, dtype=torch.long, device=device)
        if row.device_tail is not None:
            ids = torch.cat([ids, row.device_tail])
        if ids.numel():
            counts[i].index_add_(0, ids, torch.ones(ids.shape[0], device=device))
        if p.repetition_penalty != 1.0:
            seen[i, to_device(row.prompt_ids, dtype=torch.long, device=device)] = True  # output: counts > 0
    seen, counts = seen[:, :vocab], counts[:, :vocab]
    seen |= counts > 0
    md.cache["penalty"] = tensors = (rep, pres, freq, seen, counts)
    return tensors


def _apply_penalties(out: torch.Tensor, md: SamplingMetadata) -> None:
    rep, pres, freq, seen, counts = _penalty_tensors(md, out.shape[1], out.device)
    if md.row_index is not None:
        rep, pres, freq, seen, counts = (t[md.row_index] for t in (rep, pres, freq, seen, counts))
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
