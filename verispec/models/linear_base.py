"""LinearBase: what every linear layer implements, whatever its weights' format.

`make_linear` (models/linear.py) picks the class for a weight, the device and the tier; the
model's layers and the weight updates (models/weights.py) see only this interface. A new weight
format is one subclass: its constructor takes the loader's weight (dense tensor, QuantizedWeight,
GGUF blocks) and lays it out for its kernel, `_matmul` multiplies, and a layer that holds its
dense values says so (`holds_dense`, `matrix`, `part`) so that an update can write into them in
place; the others are rebuilt from the loader's form of the new values.
"""

from __future__ import annotations

import torch
from torch import nn


class LinearBase(nn.Module):
    """y = x W^T (+ bias) for W [N, K]."""

    # Whether `matrix` and `part` reach the layer's own dense values (else an update rebuilds it).
    holds_dense: bool = False

    def __init__(self, bias: torch.Tensor | None = None):
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T, without the bias."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T, the bias left out (the o and down projections have none); a class may
        fuse the add."""
        return residual + self._matmul(x)

    def matrix(self) -> torch.Tensor:
        """The [N, K] dense values (only where `holds_dense`)."""
        raise TypeError(f"{type(self).__name__} holds no dense matrix")

    def part(self, start: int, size: int, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the layer's tensor holding rows start..start+size of W, `values` [size, K] laid out as it),
        for an update written in place; None where the rows cannot be written alone (rebuild)."""
        return None
