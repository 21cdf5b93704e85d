"""The drafter's training loop (verispec/train/trainer.py): batches that show each block what it
sees at inference, a run resumed from its state that equals one run straight through, and a
loss that falls where there is something to learn."""

from __future__ import annotations

import json

import pytest
import torch

from test_dspark_model import tiny_drafter, tiny_sample
from verispec.train.distill import Sample
from verispec.train.trainer import TrainConfig, make_batch, train


def test_batch_blocks_see_their_context_and_block_only():
    s = tiny_sample(n=12, start=5)
    b = make_batch([s, tiny_sample(n=9, start=7, seed=2)], 4, 3, torch.Generator().manual_seed(0))
    anchors = b["anchors"][0].tolist()
    assert all(5 <= p <= 10 for p in anchors) and anchors == sorted(anchors)
    mask = b["mask"][0, 0]
    t_max = b["ids"].shape[1]
    for a, p in enumerate(anchors):
        for k in range(4):
            row = 4 * a + k
            assert mask[row, :t_max].tolist() == [t < p for t in range(t_max)]
            assert mask[row, t_max:].tolist() == [r // 4 == a for r in range(12)]
            real = p + k + 1 < 12
            assert b["labels"][0, row].item() == (s.ids[p + k + 1].item() if real else -1)
            assert (b["weight"][0, row] > 0).item() == real
    # The second sequence has only answer positions 7 (an anchor needs a label after it): one
    # real anchor, the other two padding with no weight.
    assert (b["weight"][1].view(3, 4).sum(1) > 0).tolist() == [True, False, False]


def copy_task(n: int) -> list[Sample]:
    """Answers that count upward: each token's successor is the next id, learnable from the
    anchor alone (the Markov head and the lm head)."""
    out = []
    for i in range(n):
        ids = torch.arange(10 + i, 10 + i + 20, dtype=torch.int32) % 500 + 4
        top = torch.stack([ids.roll(-1), ids], 1).int()
        probs = torch.tensor([[0.9, 0.1]]).expand(20, 2).half()
        out.append(Sample(ids, 4, torch.randn(20, 128).bfloat16(), top, probs))
    return out


def test_loss_falls_and_a_resumed_run_equals_a_straight_one(tmp_path):
    data = copy_task(16)
    cfg = TrainConfig(steps=30, seqs_per_step=4, anchors=4, lr=3e-3, save_every=10)
    straight = tiny_drafter()
    log = train(straight, data, data[:2], cfg, tmp_path / "a")
    first = sum(e["loss"] for e in log[:5]) / 5
    last = sum(e["loss"] for e in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert log[-1]["held_out_top1"] > log[9]["held_out_top1"]
    assert len((tmp_path / "a" / "loss.jsonl").read_text().splitlines()) == 30

    with pytest.raises(KeyboardInterrupt):  # stopped after step 20's save
        train(tiny_drafter(), data, data[:2], cfg, tmp_path / "b", progress=_stop_after(20))
    resumed = tiny_drafter()
    log_b = train(resumed, data, data[:2], cfg, tmp_path / "b")
    lines = [json.loads(x) for x in (tmp_path / "b" / "loss.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines] == list(range(1, 31)) and len(log_b) == 30
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), name


def _stop_after(n: int):
    def progress(step, total, entry):
        if step == n:
            raise KeyboardInterrupt
    return progress
