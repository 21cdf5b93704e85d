"""Graphs of consecutive layers (models/layer_graph.py): signatures, the pieces' plan; compiling and
the bitwise check against eager run in test_compile.py."""

from __future__ import annotations

import torch

from verispec.models.layer_graph import layer_signature, plan_pieces


class _Layer(torch.nn.Module):
    def __init__(self, fmt: int):
        super().__init__()
        self.fmt, self.index = fmt, None
        self.register_buffer("w", torch.zeros(4, 4 + fmt))


def test_pieces_share_a_graph_by_signature_and_every_layer_graphs_are_their_own():
    layers = [_Layer(f) for f in (0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0)]
    for i, layer in enumerate(layers):
        layer.index = i  # the index is no part of a signature
    assert layer_signature(layers[0]) == layer_signature(layers[1]) != layer_signature(layers[3])
    plan = plan_pieces(layers, per_graph=4)
    assert [(a, b) for a, b, _ in plan] == [(0, 4), (4, 8), (8, 11)]
    assert len({key for _, _, key in plan}) == 3  # (0, 0, 0, 1), (0, 0, 0, 0), (0, 0, 0)
    assert plan_pieces(layers[4:], per_graph=3)[0][2] == plan_pieces(layers[:3], per_graph=3)[0][2]
    # A drafter reading layers' outputs cuts nothing: the same pieces, graphs returning every layer's output.
    every = plan_pieces(layers, every=True, per_graph=4)
    assert [(a, b) for a, b, _ in every] == [(a, b) for a, b, _ in plan]
    assert not {key for _, _, key in every} & {key for _, _, key in plan}


def test_a_long_run_is_cut_for_the_fewest_graphs_then_the_fewest_pieces():
    """16 identical layers: four pieces of 4 (one graph to compile), not 6 + 6 + 4 (two); 22: no
    period from 6 down to 3 divides it, 6 + 6 + 6 + 4; a Q4_K_M file's pattern (Q6_K every third
    layer, two at each end): 2 + 6 + 6 + 2, two graphs where runs of one format would make four."""
    def spans(formats):
        plan = plan_pieces([_Layer(f) for f in formats], per_graph=6)
        return [(a, b) for a, b, _ in plan], len({key for _, _, key in plan})

    assert spans([0] * 16) == ([(0, 4), (4, 8), (8, 12), (12, 16)], 1)
    assert spans([0] * 30) == ([(i, i + 6) for i in range(0, 30, 6)], 1)
    assert spans([0] * 22) == ([(0, 6), (6, 12), (12, 18), (18, 22)], 2)
    q4_k_m = [1 if i < 2 or i >= 14 or (i - 2) % 3 == 2 else 0 for i in range(16)]
    assert spans(q4_k_m) == ([(0, 2), (2, 8), (8, 14), (14, 16)], 2)
