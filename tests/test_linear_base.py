"""The one interface of linear layers (models/linear_base.py): every layer `make_linear` builds
implements it, a new format is one subclass, and the dense ones expose their values for updates."""

from __future__ import annotations

import pytest
import torch

from verispec.models import linear
from verispec.models.gguf_blocks import quantize_blocks
from verispec.models.linear import make_linear
from verispec.models.linear_base import LinearBase
from verispec.models.quant import quantize_rtn

CPU = torch.device("cpu")


def weights(n: int = 48, k: int = 256) -> dict:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    return {"dense": w, "int4": quantize_rtn(w, 4), "int8": quantize_rtn(w, 8), "q4_k": quantize_blocks(w, "Q4_K")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["dense", "int4", "int8", "q4_k"])
def test_every_layer_make_linear_builds_is_a_linear_base(kind, dtype):
    w = weights()[kind]
    bias = torch.randn(48)
    layer = make_linear(w, dtype, CPU, None)
    assert isinstance(layer, LinearBase)
    x, residual = torch.randn(3, 256).to(dtype), torch.randn(3, 48).to(dtype)
    assert torch.equal(layer.forward_residual(x, residual), residual + layer(x)) or layer.holds_dense  # Linear fuses (no bias here)
    with_bias = make_linear(w, dtype, CPU, bias)
    assert torch.allclose(with_bias(x).float(), layer(x).float() + bias.to(dtype).float(), rtol=2e-2, atol=0.1)
    if layer.holds_dense:  # the values an in-place update writes into
        assert torch.allclose(layer.matrix().float(), w.to(dtype).float())
    else:
        with pytest.raises(TypeError, match="holds no dense matrix"):
            layer.matrix()
        assert layer.part(0, 16, torch.zeros(16, 256)) is None


def test_a_new_format_is_one_subclass():
    class Scaled(LinearBase):  # y = 2 x W^T, the least a format needs
        def __init__(self, w, bias=None):
            super().__init__(bias)
            self.register_buffer("w", w)

        def _matmul(self, x):
            return 2 * x @ self.w.t()

    w, x, b = torch.randn(4, 8), torch.randn(2, 8), torch.randn(4)
    layer = Scaled(w, b)
    assert torch.allclose(layer(x), 2 * x @ w.t() + b)
    assert torch.allclose(layer.forward_residual(x, torch.ones(2, 4)), 1 + layer(x) - b)  # no bias in the residual path
    assert all(issubclass(getattr(linear, name), LinearBase) for name in
               ("Linear", "DenseLinear", "QuantLinear", "DecodedLinear", "PackedLinear", "StackedLinear"))
