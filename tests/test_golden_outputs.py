"""Behaviour kept bit for bit: the digests of tests/golden_outputs.py's requests under every engine
shape equal the ones recorded on this machine's kind of CPU kernels (tests/data/golden_outputs.json).

Bitwise results depend on the kernels' level and on torch's own kernels, so each recording is
keyed by both. A machine whose key has no recording fails and says how to record one
(`VERISPEC_RECORD_GOLDEN=1`), to be done on a commit whose behaviour is the reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from golden_outputs import SMOLLM2_EXACT, SMOLLM2_FAST, smollm2_digests, tiny_digests
from conftest import make_tiny_checkpoint

from verispec.models.cpu_kernels import kernel_build

RECORDED = Path(__file__).parent / "data" / "golden_outputs.json"
RECORD = os.environ.get("VERISPEC_RECORD_GOLDEN") == "1"


def machine_key() -> str:
    """The kernels' level and packed variant, and torch's release (its CPU kernels are the same
    code in the CPU and CUDA wheels, so the local build label is left out)."""
    return f"{kernel_build().describe()} | torch {torch.__version__.split('+')[0]}"


@pytest.fixture(scope="module")
def recorded() -> dict[str, str]:
    table = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
    key = machine_key()
    if not RECORD:
        assert key in table, (f"no golden digests for {key!r}; record them on a reference commit with "
                              "VERISPEC_RECORD_GOLDEN=1 pytest tests/test_golden_outputs.py")
    yield table.setdefault(key, {})
    if RECORD:
        RECORDED.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def _check(recorded: dict[str, str], got: dict[str, str]) -> None:
    if RECORD:
        recorded.update(got)
        return
    changed = sorted(name for name in got if recorded.get(name) != got[name])
    assert changed == [], f"outputs changed bit for bit under: {changed}"


def test_fast_tier_outputs_unchanged(recorded):
    _check(recorded, smollm2_digests("auto", SMOLLM2_FAST))


def test_exact_tier_outputs_unchanged(recorded):
    _check(recorded, smollm2_digests("float32", SMOLLM2_EXACT))


def test_draft_model_and_tensor_parallel_outputs_unchanged(recorded, tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    target = make_tiny_checkpoint(root / "target", "llama")
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=99, num_hidden_layers=1)
    _check(recorded, tiny_digests(target, draft))
