"""The training loop: packed batches of blocks, AdamW with warm-up and a cosine decay, a resumable
state every few steps, and a loss log (one JSON line per step) for the curve in the docs."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.train.distill import Sample
from verispec.train.dspark_model import TrainableDSpark, slot_weights


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    seqs_per_step: int = 8
    anchors: int = 32  # blocks per sequence per step
    lr: float = 6e-4
    warmup: float = 0.04  # share of the steps
    final_lr: float = 0.1  # share of lr the cosine ends at
    clip: float = 1.0
    save_every: int = 25
    seed: int = 0


def make_batch(samples: list[Sample], block: int, anchors: int, gen: torch.Generator) -> dict:
    """Pack the samples: A anchors each (drawn among answer positions), their blocks' labels,
    slot weights (a contiguous run of real labels), the target's top entries and the mask."""
    n_seq, t_max = len(samples), max(len(s.ids) for s in samples)
    r = anchors * block
    decay = slot_weights(block)
    feat_dim, k = samples[0].features.shape[1], samples[0].top_ids.shape[1]
    out = {"ids": torch.zeros(n_seq, t_max, dtype=torch.long), "features": torch.zeros(n_seq, t_max, feat_dim),
           "anchors": torch.zeros(n_seq, anchors, dtype=torch.long), "labels": torch.full((n_seq, r), -1),
           "weight": torch.zeros(n_seq, r), "top_ids": torch.zeros(n_seq, r, k, dtype=torch.int32),
           "top_probs": torch.zeros(n_seq, r, k), "mask": torch.zeros(n_seq, 1, r, t_max + r, dtype=torch.bool)}
    slot = torch.arange(block)
    same_block = (torch.arange(r)[:, None] // block) == (torch.arange(r)[None, :] // block)
    for i, s in enumerate(samples):
        n = len(s.ids)
        out["ids"][i, :n] = s.ids.long()
        out["features"][i, :n] = s.features.float()
        first, last = s.answer_start, n - 2  # an anchor has at least one label after it
        choices = torch.arange(first, last + 1)
        if len(choices) == 0:
            continue
        pick = choices[torch.randperm(len(choices), generator=gen)[:anchors]]
        used = len(pick)
        pick = torch.cat([pick, pick[:1].expand(anchors - used)]).sort().values if used < anchors else pick.sort().values
        out["anchors"][i] = pick
        pos = (pick[:, None] + slot).flatten()  # slot k of anchor p sits at p + k, predicts p + k + 1
        real = (pos + 1 < n).view(anchors, block).cumprod(dim=1).flatten().bool()
        real.view(anchors, block)[used:] = False  # padding anchors
        at = pos.clamp(max=n - 2)
        out["labels"][i] = torch.where(real, s.ids.long()[at + 1], -1)
        out["weight"][i] = decay.repeat(anchors) * real
        out["top_ids"][i], out["top_probs"][i] = s.top_ids[at], s.top_probs[at].float()
        out["mask"][i, 0, :, :t_max] = torch.arange(t_max)[None, :] < pick.repeat_interleave(block)[:, None]
        out["mask"][i, 0, :, t_max:] = same_block
    return out


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.final_lr + (1 - cfg.final_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def train(model: TrainableDSpark, samples: list[Sample], held_out: list[Sample], cfg: TrainConfig, out: Path,
          progress=None) -> list[dict]:
    """Trains `model` in place for cfg.steps, resuming from out/train_state.pt if there; the
    log's lines (step, loss parts, held-out ones every save) are also in out/loss.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    state_path, log_path = out / "train_state.pt", out / "loss.jsonl"
    start, log = 0, []
    if state_path.exists():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["step"]
        log = [json.loads(line) for line in log_path.read_text().splitlines()][:start] if log_path.exists() else []
        log_path.write_text("".join(json.dumps(e) + "\n" for e in log))  # steps after the last save run again
    held = make_batch(held_out, model.shape.block_size, cfg.anchors, torch.Generator().manual_seed(1)) if held_out else None
    began = time.perf_counter()
    for step in range(start, cfg.steps):
        batch = make_batch(_pick(samples, step, cfg), model.shape.block_size, cfg.anchors,
                           torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
        loss, parts = model(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        sched.step()
        entry = {"step": step + 1, "loss": loss.item(), **parts, "lr": sched.get_last_lr()[0],
                 "seconds": time.perf_counter() - began}
        last = step + 1 == cfg.steps
        if (step + 1) % cfg.save_every == 0 or last:
            if held is not None:
                with torch.no_grad():
                    held_loss, held_parts = model(held)
                entry |= {"held_out_loss": held_loss.item()} | {f"held_out_{k}": v for k, v in held_parts.items()}
            _save(model, opt, sched, step + 1, state_path)
        log.append(entry)
        with log_path.open("a" if step else "w") as f:
            f.write(json.dumps(entry) + "\n")
        if progress is not None:
            progress(step + 1, cfg.steps, entry)
    return log


def _pick(samples: list[Sample], step: int, cfg: TrainConfig) -> list[Sample]:
    """The step's sequences: epoch after epoch, each a fresh shuffle (a function of the step, so
    a resumed run draws what the first would have)."""
    per_epoch = max(1, len(samples) // cfg.seqs_per_step)
    epoch, slot = divmod(step, per_epoch)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.seed + epoch))
    return [samples[int(i)] for i in order[slot * cfg.seqs_per_step : (slot + 1) * cfg.seqs_per_step]]


def _save(model, opt, sched, step: int, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step}, tmp)
    tmp.replace(path)
