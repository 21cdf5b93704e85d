"""The trainable DSpark drafter (verispec/train/dspark_model.py): what it computes for a block is
what the serving network (verispec/models/dspark.py) computes from its export, and its losses
are the recipe's."""

from __future__ import annotations

import torch

from verispec.models.dspark import DSparkModel
from verispec.models.dspark_checkpoint import read_dspark_checkpoint
from verispec.train.distill import Sample
from verispec.train.dspark_model import DrafterShape, TrainableDSpark
from verispec.train.trainer import make_batch

SHAPE = DrafterShape(target_layer_ids=(0, 2), mask_token_id=3, num_layers=2, block_size=4, markov_rank=8,
                     hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                     rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=512)


def tiny_drafter(seed: int = 0) -> TrainableDSpark:
    torch.manual_seed(seed)
    embed = torch.randn(512, 64)
    model = TrainableDSpark(SHAPE, embed, torch.arange(0, 512, 3))  # a reduced vocabulary: every third id
    with torch.no_grad():  # heads that bite
        model.markov_w2.weight.normal_(0, 0.5)
        model.confidence.bias.fill_(0.3)
        model.feature_scale.uniform_(0.5, 50.0)  # folded into fc at export
    return model


def tiny_sample(n: int = 24, start: int = 6, seed: int = 0) -> Sample:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 512, (n,), generator=g, dtype=torch.int32)
    top_ids = torch.randint(0, 512, (n, 5), generator=g, dtype=torch.int32)
    return Sample(ids, start, torch.randn(n, 128, generator=g).bfloat16(), top_ids,
                  torch.softmax(torch.randn(n, 5, generator=g), -1).half())


def test_export_serves_what_it_trained(tmp_path):
    """Each anchor's block through the served network, its context from the cache's math, equals
    the training pass's rows: the same logits (Markov bias chained on the true tokens) and chances."""
    model = tiny_drafter()
    model.export(tmp_path / "d", dtype=torch.float32)
    cfg, tensors = read_dspark_checkpoint(tmp_path / "d")
    assert "lm_head.weight" not in tensors  # the target's rows, taken from the target
    served = DSparkModel(cfg, tensors, 512, torch.float32, torch.device("cpu"), head_rows=lambda ids: model.embed[ids])
    sample = tiny_sample()
    batch = make_batch([sample], 4, 5, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, chance = model.block_logits(batch)
    feats, ids = sample.features.float(), sample.ids.long()
    for a, p in enumerate(batch["anchors"][0].tolist()):
        ctx = served.context_kv(feats[:p], torch.arange(p))
        ctx = [(k[None], v[None]) for k, v in ctx]
        block = torch.tensor([ids[p].item()] + [3] * 3)
        hidden = served.block(model.embed[block], torch.arange(p, p + 4), ctx, torch.zeros(1, 1, 1, p + 4))
        prev = ids[torch.arange(p, p + 4).clamp(max=len(ids) - 1)]
        want = served.logits(hidden, None) + served.markov_bias(prev)
        rows = slice(4 * a, 4 * a + 4)
        assert torch.allclose(logits[0, rows], want, atol=1e-4), (p, (logits[0, rows] - want).abs().max())
        assert torch.allclose(torch.sigmoid(chance[0, rows]), served.accept_chance(hidden, prev), atol=1e-5)
    assert torch.equal(served.d2t, torch.arange(0, 512, 3))


def test_losses_are_the_recipes():
    model = tiny_drafter()
    batch = make_batch([tiny_sample(), tiny_sample(30, 4, seed=1)], 4, 6, torch.Generator().manual_seed(0))
    loss, parts = model(batch)
    assert torch.isclose(loss, torch.tensor(0.1 * parts["ce"] + 0.9 * parts["tv"] + parts["conf"]), rtol=1e-5)
    assert 0 <= parts["accept"] <= 1 and 0 <= parts["tv"] <= 2 and 0 <= parts["top1"] <= 1
    loss.backward()
    assert model.fc.weight.grad.abs().sum() > 0 and model.markov_w1.weight.grad.abs().sum() > 0
    assert model.confidence.weight.grad.abs().sum() > 0


def test_export_names_and_precision(tmp_path):
    model = tiny_drafter()
    model.export(tmp_path / "d")
    cfg, t = read_dspark_checkpoint(tmp_path / "d")
    assert cfg.is_dspark and cfg.sample_from_anchor and cfg.draft_vocab_size == len(range(0, 512, 3))
    assert cfg.target_layer_ids == (0, 2) and cfg.mask_token_id == 3 and cfg.layers.num_layers == 2
    assert t["layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert t["confidence_head.proj.bias"].dtype == torch.float32


def test_start_from_the_features_scale_and_the_targets_norm():
    model = tiny_drafter()
    feats = [torch.tensor([[3.0, 0.0] * 64, [4.0, 2.0] * 64]), torch.tensor([[0.0, 0.0] * 64])]
    norm = torch.full((64,), 2.5)
    from verispec.train.dspark_model import start_from

    start_from(model, norm, feats)
    assert torch.allclose(model.feature_scale[:2], torch.tensor([(25 / 3) ** 0.5, (4 / 3) ** 0.5]))
    assert model.feature_scale.min() > 0 and torch.equal(model.norm.weight.detach(), norm)
