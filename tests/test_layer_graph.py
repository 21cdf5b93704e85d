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


def test_pieces_share_a_graph_by_signature_and_end_at_the_layers_a_drafter_reads():
    layers = [_Layer(f) for f in (0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0)]
    for i, layer in enumerate(layers):
        layer.index = i  # the index is no part of a signature
    assert layer_signature(layers[0]) == layer_signature(layers[1]) != layer_signature(layers[3])
    plan = plan_pieces(layers, cuts={5}, per_graph=4)
    assert [(a, b) for a, b, _ in plan] == [(0, 3), (3, 4), (4, 6), (6, 10), (10, 11)]
    assert len({key for _, _, key in plan}) == 5  # lengths 3, 1 (other format), 2, 4, 1
    assert plan_pieces(layers[4:], cuts=set(), per_graph=3)[0][2] == plan_pieces(layers[:3], cuts=set(), per_graph=3)[0][2]


def test_a_long_run_is_cut_into_equal_pieces_where_it_can_be():
    """16 identical layers: four pieces of 4 (one graph to compile), not 6 + 6 + 4 (two); 22 has no
    length from 6 down to 3 that divides it: 6 + 6 + 6 + 4."""
    sixteen = plan_pieces([_Layer(0) for _ in range(16)], cuts=set(), per_graph=6)
    assert [(a, b) for a, b, _ in sixteen] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert len({key for _, _, key in sixteen}) == 1
    twenty_two = plan_pieces([_Layer(0) for _ in range(22)], cuts=set(), per_graph=6)
    assert [b - a for a, b, _ in twenty_two] == [6, 6, 6, 4]
