"""benchmarks (python -m benchmarks): the pure parts (options, ratios, tables, targets, peer skipping), no model, no timing."""

from __future__ import annotations

import argparse
import builtins
import json
from pathlib import Path

import pytest

from benchmarks import runner
from benchmarks.adaptive import (
    ADAPTIVE,
    HIGH,
    LOW,
    POOL,
    AdaptiveRow,
    batch_of,
    format_adaptive_table,
    format_summary,
    summarize,
    target_met,
)
from benchmarks.peers import (
    PLAIN,
    SPEC,
    Generation,
    PeerUnavailable,
    acceptance_from_lengths,
)
from benchmarks.prompts import Prompt, extractive_prompt, long_prompt
from benchmarks.report import (
    THROUGHPUT,
    TTFT,
    Result,
    format_table,
    format_ttft_table,
    ratios,
)
from benchmarks.scenarios import SCENARIOS, compare, headlines, max_abs_diff
from benchmarks.targets import TARGETS, evaluate, format_targets
from benchmarks.__main__ import build_parser


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _row(system: str, scenario: str, tok_s: list[float], variant: str = PLAIN, metric: str = THROUGHPUT,
         label: str | None = None, load: float = 0.0) -> Result:
    r = Result(system, label or f"{system}{'' if variant == PLAIN else ' + spec'}", scenario, 1, 128,
               variant=variant, metric=metric, prompt_tokens=2000)
    r.tokens = [128 if metric == THROUGHPUT else 1] * len(tok_s)
    r.seconds = [t / v for t, v in zip(r.tokens, tok_s)]
    r.others_load = [load] * len(tok_s)
    return r


# ---------------------------------------------------------------------------------- options
def test_defaults_and_quick():
    full = runner._resolve(_args())
    assert (full.max_tokens, full.runs, full.quick) == (128, 3, False)
    assert full.peers == ["hf", "llamacpp"]
    assert full.scenarios == ["single", "batch16", "batch16_logprobs", "extractive", "ttft", "spec", "adaptive"]
    quick = runner._resolve(_args("--quick", "--out", "x"))
    assert (quick.max_tokens, quick.runs, quick.out) == (32, 1, Path("x"))


def test_explicit_values_win_over_quick_and_none_means_no_peers():
    cfg = runner._resolve(_args("--quick", "--max-tokens", "7", "--runs", "2", "--peers", "none",
                                "--scenarios", "ttft, extractive,ttft", "--threads", "1"))
    assert (cfg.max_tokens, cfg.runs, cfg.peers, cfg.threads) == (7, 2, [], 1)
    assert cfg.scenarios == ["ttft", "extractive"]  # order kept, duplicates dropped
    assert cfg.adaptive_queue == 1 and runner._resolve(_args("--adaptive-queue", "3")).adaptive_queue == 3


@pytest.mark.parametrize("argv, word", [
    (("--peers", "vllm"), "vllm"),
    (("--scenarios", "single,nope"), "nope"),
    (("--max-tokens", "0"), "--max-tokens"),
    (("--runs", "0"), "--runs"),
    (("--adaptive-queue", "0"), "--adaptive-queue"),
    (("--scenarios", ","), "no scenario"),
])
def test_bad_options_are_rejected(argv, word):
    with pytest.raises(ValueError, match=word):
        runner._resolve(_args(*argv))


def test_bad_option_exits_2_without_loading_anything(capsys):
    assert runner.run(_args("--peers", "vllm")) == 2
    assert "unknown peer" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- ratios
def test_ratios_use_the_headline_variant_and_invert_ttft():
    rows = [
        _row("verispec", "extractive", [20.0]),
        _row("verispec", "extractive", [40.0], variant=SPEC),
        _row("llamacpp", "extractive", [50.0]),
        _row("verispec", "ttft", [1 / 2.0], metric=TTFT),  # 2 s to the first token
        _row("hf", "ttft", [1 / 3.0], metric=TTFT),  # 3 s
    ]
    rel = ratios(rows, headlines())
    assert rel["extractive"] == pytest.approx({"verispec": 2.0, "llamacpp": 0.8})
    # HF takes 1.5x verispec's time to the first token: >1 means verispec is better, as elsewhere.
    assert rel["ttft"] == pytest.approx({"hf": 1.5})
    assert "verispec + spec" not in rel["extractive"]  # the headline is not compared with itself


def test_median_min_max_and_acceptance():
    r = _row("verispec", "single", [10.0, 30.0, 20.0], variant=SPEC)
    assert r.median == pytest.approx(20.0)
    assert r.acceptance is None  # a run that did not report speculation
    r.spec_steps, r.spec_tokens = 10, 35
    assert r.acceptance == pytest.approx(3.5)
    r.spec_steps, r.spec_tokens = 0, 0
    assert r.acceptance == 1.0  # no draft was ever proposed


def test_acceptance_from_drafter_calls():
    # Prompt of 100; calls at 101 (3 drafts), 104 (0 drafts), 105 (2 drafts); generation ends at 108.
    assert acceptance_from_lengths([(101, 3), (104, 0), (105, 2)], 108) == (2, 3 + 3)
    assert acceptance_from_lengths([], 120) == (0, 0)


# ---------------------------------------------------------------------------------- tables
def test_table_has_the_correctness_columns():
    a = _row("verispec", "extractive", [20.0], label="verispec")
    a.equal, a.logprob_diff = "reference", 1.5e-5
    b = _row("verispec", "extractive", [40.0], variant=SPEC, label="verispec + ngram k=5")
    b.equal, b.spec_steps, b.spec_tokens = "yes (ids)", 4, 14
    c = _row("hf", "extractive", [10.0], label="HF transformers", load=0.9)
    c.equal = "yes (ids)"
    text = format_table([a, b, c], headline=headlines())
    lines = text.splitlines()
    assert "mean acceptance length" in lines[0] and "max abs logprob diff vs HF" in lines[0]
    assert "1.5e-05" in lines[2] and "2.00x" in lines[2]  # spec over plain
    assert "3.50" in lines[3]
    assert "4.00x" in lines[4] and "(busy)" in lines[4]
    md = format_table([a, b, c], markdown=True, headline=headlines()).splitlines()
    assert md[0].startswith("| scenario |") and md[1].startswith("|---|") and len(md) == 5


def test_ttft_table_and_its_absence():
    rows = [_row("verispec", "ttft", [1 / 2.0], metric=TTFT, label="verispec"),
            _row("hf", "ttft", [1 / 4.0], metric=TTFT, label="HF transformers")]
    text = format_ttft_table(rows)
    assert "2000" in text and "4000" in text and "2.00x" in text and "1000" in text  # 2000 tok / 2 s
    assert format_table(rows).count("\n") == 1  # TTFT rows stay out of the tok/s table
    assert format_ttft_table(rows[:0]) == ""


# ---------------------------------------------------------------------------------- targets
def test_targets_met_missed_busy_and_not_measured():
    rows = [_row("verispec", "single", [21.0]), _row("hf", "single", [10.0]),
            _row("verispec", "batch16", [100.0]), _row("hf", "batch16", [50.0], load=0.8),
            _row("verispec", "ttft", [1.0], metric=TTFT), _row("hf", "ttft", [0.5], metric=TTFT)]
    by_name = {o.target.name: o for o in evaluate(rows)}
    assert len(by_name) == len(TARGETS)
    single = by_name["single stream chat: verispec >= 2x HF generate"]
    assert single.ratio == pytest.approx(2.1) and single.status == "met"
    assert by_name["16 concurrent: verispec >= 5x HF batched"].status == "missed (busy)"
    assert by_name["16 concurrent: verispec >= 3x llama-cpp-python"].status == "not measured"
    assert by_name["TTFT, 2k-token prompt: verispec <= HF"].ratio == pytest.approx(2.0)
    assert "not measured" in format_targets(evaluate(rows))
    assert format_targets(evaluate(rows), markdown=True).startswith("| target |")


# ---------------------------------------------------------------------------------- correctness
def test_compare_ids_text_and_reference():
    ref = Generation(["a b", "c"], [[1, 2], [3]], [2, 1])
    assert compare("ids", ref, ref, is_reference=True) == "reference"
    assert compare("ids", Generation(["a b", "c"], [[1, 2], [3]], [2, 1]), ref) == "yes (ids)"
    assert compare("ids", Generation(["", ""], [[1, 9], [3]], [2, 1]), ref) == \
        "no (1/2 ids, first diff at token 1)"
    assert compare("text", Generation(["a b", "x"], None, [2, 1]), ref) == "no (1/2 text)"
    assert compare("ids", ref, None) == "n/a"


def test_max_abs_diff():
    assert max_abs_diff([[-1.0, -2.0], [-0.5]], [[-1.0, -2.25], [-0.375]]) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        max_abs_diff([[-1.0]], [[-1.0, -2.0]])


# ---------------------------------------------------------------------------------- prompts
class _WordTokenizer:
    """Chat template + whitespace tokenizer: enough to size prompts without a model."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        text = "<user> " + messages[0]["content"] + " <assistant>"
        return list(range(len(text.split()))) if tokenize else text


def test_long_and_extractive_prompts():
    tok = _WordTokenizer()
    long = long_prompt(tok, 1500)
    assert 1500 <= len(long.ids) < 1500 + 200
    assert long.text.endswith("<assistant>")
    ex = extractive_prompt(tok)
    assert "Elm Street" in ex.text and len(ex.ids) > 300
    with pytest.raises(ValueError):
        long_prompt(tok, 0)


def test_scenario_table():
    assert SCENARIOS["extractive"].variants == (PLAIN, SPEC) and SCENARIOS["extractive"].headline == SPEC
    assert SCENARIOS["ttft"].fixed_tokens == 1 and SCENARIOS["ttft"].metric == TTFT
    assert SCENARIOS["batch16_logprobs"].verispec_only


# ---------------------------------------------------------------------------------- peers
class _FakeSystem:
    key, label, compare = "verispec", "verispec", "ids"

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, int | None]] = []

    def variant_label(self, variant: str) -> str:
        return self.label if variant == PLAIN else "verispec + spec"

    def generate(self, prompts, max_tokens, variant=PLAIN, logprobs=None):
        self.calls.append((max_tokens, variant, logprobs))
        ids = [[7] * max_tokens for _ in prompts]
        gen = Generation(["x"] * len(prompts), ids, [max_tokens] * len(prompts))
        if variant == SPEC:
            gen.spec_steps, gen.spec_tokens = 2, 6
        if logprobs:
            gen.logprobs = [[-0.5] * max_tokens for _ in prompts]
        return gen

    def close(self) -> None:
        pass


def test_unavailable_peer_is_skipped_with_its_install_command(monkeypatch):
    fake = _FakeSystem()

    def load(key, *args):
        if key == "llamacpp":
            raise PeerUnavailable("llama-cpp-python is not installed (no module); `pip install llama-cpp-python`")
        return fake

    monkeypatch.setattr(runner, "load_system", load)
    cfg = runner._resolve(_args("--peers", "llamacpp", "--scenarios", "single,extractive,ttft", "--runs", "2",
                                "--max-tokens", "4"))
    prompt = Prompt("q", "q", [1, 2, 3])
    state = runner.RunState()
    assert runner._measure_all(cfg, "model.gguf", 2, None, {s: [prompt] for s in cfg.scenarios}, state)
    assert "pip install llama-cpp-python" in state.skipped["llamacpp"]
    rows = {(r.scenario, r.variant): r for r in state.results}
    assert set(rows) == {("single", PLAIN), ("extractive", PLAIN), ("extractive", SPEC), ("ttft", PLAIN)}
    assert rows["ttft", PLAIN].tokens == [1, 1]  # TTFT always generates one token
    assert rows["extractive", SPEC].acceptance == pytest.approx(3.0)  # 12 tokens over 4 steps, 2 runs
    assert rows["extractive", SPEC].equal == "yes (ids)"
    assert [c.result.scenario for c in state.checks] == ["single", "extractive", "extractive"]
    assert (4, PLAIN, 1) in fake.calls  # the untimed logprob run


def test_missing_llama_cpp_raises_peer_unavailable(monkeypatch):
    from benchmarks.llamacpp import LlamaCppSystem

    real_import = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name.startswith("llama_cpp"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(PeerUnavailable, match="pip install llama-cpp-python"):
        LlamaCppSystem("model.gguf", 2, print)


def _saved_figures(monkeypatch) -> list:
    """Figures as they are saved (the plot functions close them right after)."""
    from matplotlib.figure import Figure

    saved, original = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (saved.append(fig), original(fig, *a, **kw))[1])
    return saved


def test_plot_draws_the_medians_the_busy_hatch_and_a_ttft_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from benchmarks.plot import plot

    saved = _saved_figures(monkeypatch)
    rows = [_row("verispec", "single", [20.0, 22.0, 30.0]), _row("hf", "single", [10.0], load=0.9),
            _row("verispec", "ttft", [0.5], metric=TTFT)]
    plot(tmp_path / "b.png", rows, {"cpu": "test cpu", "torch_threads": 2}, 128)
    through, ttft = saved[0].axes
    bars = [p for p in through.patches]
    assert [b.get_height() for b in bars] == pytest.approx([22.0, 10.0])  # medians, in row order
    assert [b.get_hatch() for b in bars] == [None, "//"]  # hf ran while others were busy
    assert [b.get_height() for b in ttft.patches] == pytest.approx([2000.0])  # _row: 1 token in 2 s, shown in ms
    assert "test cpu, 2 threads" in saved[0]._suptitle.get_text()
    image = imread(tmp_path / "b.png")
    assert image.shape[0] == 600 and len({tuple(px) for px in image[::10, ::10].reshape(-1, image.shape[2])}) > 5


def test_json_report(tmp_path):
    from benchmarks.report import write_json

    rows = [_row("verispec", "single", [20.0]), _row("hf", "single", [10.0])]
    write_json(tmp_path / "b.json", {"machine": {}}, rows, headlines())
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["ratios_verispec_over_row"] == {"single": {"hf": 2.0}}
    assert doc["results"][0]["tok_s_median"] == pytest.approx(20.0)


# ---------------------------------------------------------------------------------- adaptive sweep
def _arow(size: int, config: str, tok_s: list[float], load: float = 0.0) -> AdaptiveRow:
    r = AdaptiveRow(size, config, tokens=[100] * len(tok_s), seconds=[100 / v for v in tok_s], others_load=load)
    if config != "none":
        r.drafts, r.accepted = 10, 15
    if config == ADAPTIVE:
        r.steps, r.admitted, r.capacity_histogram = 4, 10, [0, 1, 2, 1, 0, 0, 0]
    return r


def test_adaptive_pool_mixes_acceptance_and_cycles():
    assert len(POOL) == len(HIGH) + len(LOW) and POOL[0] in HIGH and POOL[1] in LOW
    assert all({id(c) for c in batch_of(4)} & {id(c) for c in group} for group in (HIGH, LOW))
    assert batch_of(len(POOL) + 2)[-2:] == POOL[:2]  # larger batches cycle through the pool
    assert batch_of(32) == batch_of(32)


def test_adaptive_summary_ratio_and_target():
    rows = [_arow(1, "none", [20.0]), _arow(1, "k=1", [25.0]), _arow(1, "k=6", [40.0, 44.0, 10.0]),
            _arow(1, ADAPTIVE, [39.0]),
            _arow(4, "none", [50.0]), _arow(4, "k=1", [60.0]), _arow(4, "k=6", [45.0]), _arow(4, ADAPTIVE, [66.0])]
    assert rows[2].tok_s == pytest.approx(40.0)  # median of the runs
    s1, s4 = summarize(rows)
    assert (s1.batch_size, s1.best_fixed, s1.ratio, s1.beats_all) == (1, "k=6", pytest.approx(39 / 40), False)
    assert (s4.best_fixed, s4.ratio, s4.beats_all) == ("k=1", pytest.approx(1.1), True)
    assert target_met([s1, s4])  # >= 0.95x everywhere and ahead at batch 4
    assert not target_met([s1])  # never ahead of every fixed k
    rows[3] = _arow(1, ADAPTIVE, [30.0])
    assert not target_met(summarize(rows))  # 0.75x at batch 1
    assert not target_met([])
    assert summarize([_arow(1, "none", [20.0]), _arow(1, ADAPTIVE, [30.0])]) == []  # no fixed k measured


def test_adaptive_tables():
    rows = [_arow(4, "none", [50.0]), _arow(4, "k=1", [60.0], load=0.9), _arow(4, ADAPTIVE, [75.0])]
    rows[1].identical = False
    lines = format_adaptive_table(rows).splitlines()
    assert lines[0].startswith("| batch | configuration | tok/s |") and lines[1].startswith("|---|")
    assert lines[2].split(" | ")[1:4] == ["none", "50.0", "1.00x"]
    assert "60.0 (busy)" in lines[3] and "1.20x" in lines[3] and lines[3].endswith("| NO |")
    assert "1.50x" in lines[4] and "| 2.50 | 2.5 | yes |" in lines[4]  # acceptance 1 + 15/10, 10/4 admitted
    text = format_summary(summarize(rows))
    assert "| 4 | k=1 | 60.0 | 75.0 | 1.25x (busy) | yes |" in text
    assert text.endswith("**met (busy)**.")  # met, but on a figure other processes disturbed
    assert "0.95x the best fixed k" in text
    ok = format_summary(summarize([_arow(4, "k=1", [60.0]), _arow(4, ADAPTIVE, [75.0])]))
    assert ok.endswith("**met**.")


def test_adaptive_plot_draws_one_line_per_configuration(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from benchmarks.adaptive import plot_adaptive

    saved = _saved_figures(monkeypatch)
    rows = [_arow(b, c, [10.0 * b + i]) for b in (1, 4) for i, c in enumerate(("none", "k=1", ADAPTIVE))]
    plot_adaptive(tmp_path / "a.png", rows)
    lines = {line.get_label(): line for line in saved[0].axes[0].get_lines()}
    assert list(lines) == ["none", "k=1", ADAPTIVE]
    assert list(lines["k=1"].get_xdata()) == [1, 4] and list(lines["k=1"].get_ydata()) == pytest.approx([11.0, 41.0])
    assert lines[ADAPTIVE].get_linewidth() == 2.5 and lines["none"].get_linestyle() == "--"
    assert (tmp_path / "a.png").stat().st_size > 10_000
