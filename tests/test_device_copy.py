"""Host values to a device without a synchronisation (verispec/device_copy.py): the tensor equals
`torch.tensor(data, dtype=, device=)` on the CPU and, where CUDA exists, on the GPU too, without a
synchronising copy (checked under `torch.cuda.set_sync_debug_mode("error")`)."""

from __future__ import annotations

import pytest
import torch

from verispec.device_copy import to_device


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_on_the_cpu_it_is_torch_tensor(device):
    data = [[1, 2], [3, 4]]
    got = to_device(data, dtype=torch.int64, device=device)
    assert got.device.type == "cpu" and torch.equal(got, torch.tensor(data, dtype=torch.int64))


def test_the_dtype_is_the_one_asked_for_or_torchs_own():
    assert to_device([1.5, 2.5], dtype=torch.float16).dtype == torch.float16
    assert to_device([True, False]).dtype == torch.bool  # no dtype: what torch.tensor infers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the pinned, non-blocking copy exists only there")
def test_on_cuda_the_copy_does_not_synchronise():
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = to_device([5, 6, 7], dtype=torch.long, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.is_cuda and got.tolist() == [5, 6, 7]
