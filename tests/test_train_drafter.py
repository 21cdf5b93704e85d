"""`verispec train-drafter` (verispec/entrypoints/train_drafter.py) end to end on a tiny model with
SmolLM2's tokenizer: data, training, the drafter in the published schema, the report; a rerun
resumes instead of starting over."""

from __future__ import annotations

import json

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.entrypoints.cli import main
from verispec.entrypoints.train_drafter import draft_vocabulary, spread_layers, target_layers
from verispec.train.distill import Sample


def test_spread_layers_never_takes_the_last():
    assert spread_layers(30) == (1, 8, 14, 20, 27)
    assert spread_layers(4, 2) == (1,)
    assert all(max(spread_layers(n)) < n - 1 for n in range(3, 40))


def test_target_layers_are_checked_before_any_data_is_made():
    assert target_layers(None, 30) == spread_layers(30) and target_layers("8,1,8", 30) == (1, 8)
    with pytest.raises(ValueError, match="must name layers 0..28 of the target's 30"):
        target_layers("1,29", 30)
    with pytest.raises(ValueError, match="comma-separated layer numbers"):
        target_layers("1;2", 30)


def test_draft_vocabulary_is_the_answers_commonest_tokens():
    ids = torch.tensor([9, 9, 5, 5, 5, 7, 1], dtype=torch.int32)
    s = Sample(ids, 2, torch.zeros(7, 2), torch.zeros(7, 1, dtype=torch.int32), torch.zeros(7, 1))
    assert draft_vocabulary([s], 2, 10).tolist() == [5, 7]  # the prompt's 9s do not count
    assert draft_vocabulary([s], 5, 10).tolist() == [0, 1, 2, 5, 7]  # topped up with the lowest ids


def test_train_drafter_end_to_end_and_resume(tiny_tok, tmp_path, capsys):
    args = ["train-drafter", "--model", tiny_tok, "--dtype", "float32", "--output", str(tmp_path), "--prompts", "3",
            "--answer-tokens", "8", "--steps", "4", "--seqs-per-step", "2", "--anchors", "2", "--draft-vocab", "300",
            "--markov-rank", "4", "--drafter-block", "3", "--target-layers", "0", "--eval-tokens", "6"]
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["held_out_prompts"] == 12 and report["acceptance_length"] >= 1.0
    assert len(report["accepted_per_position"]) == 3 and report["final"]["step"] == 4
    assert '"acceptance_length"' in capsys.readouterr().out
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["draft_vocab_size"] == 300 and config["block_size"] == 3
    llm = LLM(tiny_tok, dtype="float32", speculative_config={"method": "dspark", "model": str(tmp_path / "drafter")})
    plain = LLM(tiny_tok, dtype="float32").generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8),
                                                   use_tqdm=False)
    assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids \
        == plain[0].outputs[0].token_ids

    shard = tmp_path / "data" / "train" / "shard_0000.pt"
    stamp = shard.stat().st_mtime_ns
    assert main(args[:args.index("--steps") + 1] + ["6"] + args[args.index("--steps") + 2:]) == 0
    assert shard.stat().st_mtime_ns == stamp  # the data is reused
    steps = [json.loads(x)["step"] for x in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed at 4


def test_a_model_without_chat_template_is_refused(tiny_llama, tmp_path, capsys):
    assert main(["train-drafter", "--model", tiny_llama, "--output", str(tmp_path)]) == 2
    assert "chat template" in capsys.readouterr().err
