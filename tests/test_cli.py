"""verispec generate, end to end through the console entry point."""

from __future__ import annotations

import json

import pytest

from verispec.entrypoints.cli import main


@pytest.mark.slow
def test_generate_json_with_logprobs(capsys):
    code = main(["generate", "The capital of France is", "--max-tokens", "6", "--logprobs", "2",
                 "--prompt-logprobs", "1", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    completion = out["outputs"][0]
    assert "Paris" in completion["text"]
    assert len(completion["token_ids"]) == len(completion["logprobs"]) <= 6
    first = completion["logprobs"][0]
    assert str(completion["token_ids"][0]) in first and 2 <= len(first) <= 3
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(out["prompt_token_ids"])


@pytest.mark.slow
def test_generate_says_what_it_runs_on_in_one_line(capsys):
    import torch

    assert main(["generate", "Hi", "--max-tokens", "2", "--enforce-eager"]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("verispec: ")]
    capability = torch.backends.cpu.get_cpu_capability()
    assert lines == [lines[0]] and f"fast tier (bfloat16 + gguf) on {capability}, kernels " in lines[0]
    assert lines[0].endswith(", eager step")


def test_bad_option_is_one_clear_line(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "temperature" in err and "Traceback" not in err
