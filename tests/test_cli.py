"""verispec generate, end to end through the console entry point."""

from __future__ import annotations

import json

import pytest

from conftest import run_fresh
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
    assert lines == [lines[0]] and f"fast tier (bfloat16 + gguf: Q4_1, Q8_0) on {capability}, kernels " in lines[0]
    assert lines[0].endswith(", eager step")


def test_bad_option_is_one_clear_line(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "temperature" in err and "Traceback" not in err


def test_every_engine_option_is_a_flag_with_the_configs_own_default():
    from verispec.config import user_options
    from verispec.entrypoints.cli import build_parser, engine_options

    parser = build_parser()
    # Nothing given: nothing passed, so EngineConfig's defaults apply.
    assert engine_options(parser.parse_args(["serve"])) == {"speculative_config": None}
    given = parser.parse_args(["serve", "--max-num-seqs", "3", "--no-enable-prefix-caching", "-tp", "2",
                               "--dtype", "float32"])
    assert engine_options(given) == {"dtype": "float32", "max_num_seqs": 3, "enable_prefix_caching": False,
                                     "tensor_parallel_size": 2, "speculative_config": None}
    for command in ("generate", "serve", "bench"):
        sub = parser._subparsers._group_actions[0].choices[command]
        flags = {f for action in sub._actions for f in action.option_strings}
        assert {"--" + o.name.replace("_", "-") for o in user_options()} <= flags, command


def test_python_m_verispec_is_the_command():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "verispec", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and all(cmd in out.stdout for cmd in ("generate", "serve", "bench"))


def test_help_answers_without_importing_torch():
    """`verispec --help` and a command's `--help` build the parser alone (torch's import is 2 s)."""
    code = ("import sys\nfrom verispec.entrypoints.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['serve', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    run = run_fresh(code)
    assert "--max-num-seqs" in run.stdout and "--max-tokens" in run.stdout
