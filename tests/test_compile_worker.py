"""The compile worker (models/compile_worker.py): a spec without a directory is refused by name; the
engine's tests (test_compile.py) run it for real, cold and warm."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_a_spec_without_a_directory_to_save_to_is_refused():
    spec = {"model": "m.gguf", "dtype": "bfloat16", "quantization": "gguf", "rope_context": 8, "block_size": 16}
    run = subprocess.run([sys.executable, "-m", "verispec.models.compile_worker", json.dumps(spec)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert run.returncode != 0 and "names no directory" in run.stderr
