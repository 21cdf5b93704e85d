"""Host values to the device without synchronising.

A CUDA copy from pageable host memory waits for the stream (and fails under
`torch.cuda.set_sync_debug_mode("error")`, which the step must pass). Staging
the values in pinned memory and copying with non_blocking=True queues the copy instead; the
caching host allocator keeps the staging buffer alive until the copy has run. On the CPU the
tensor is simply built in place.
"""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)`, minus the synchronisation."""
    host = torch.tensor(data, dtype=dtype)
    if device is None or torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
