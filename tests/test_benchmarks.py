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
from benchmarks.fidelity import Fidelity
from benchmarks.tiers import (
    EXACT,
    FAST,
    FIDELITY_FULL,
    FIDELITY_QUICK,
    TIERS,
    FidelityRow,
    fidelity_size,
    format_fidelity_table,
)
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


FAST_TARGETS = {
    "single": "single stream chat: verispec fast >= 1.2x llama-cpp-python plain",
    "batch16": "16 concurrent: verispec fast >= 4x llama-cpp-python",
    "extractive": "extractive: verispec fast best drafter >= 2x llama-cpp-python plain",
    "ttft": "TTFT, 2k-token prompt: verispec fast <= 0.5x HF fp32 (time ratio, lower is better)",
}


def test_fast_tier_targets_compare_its_own_rows_with_the_peers():
    rows = [_row(FAST.key, "single", [40.0]), _row("llamacpp", "single", [32.0]),
            _row(FAST.key, "batch16", [250.0]), _row("llamacpp", "batch16", [70.0]),
            _row(FAST.key, "extractive", [30.0]), _row(FAST.key, "extractive", [70.0], variant=SPEC),
            _row("llamacpp", "extractive", [30.0], load=0.9),
            # The exact tier's rows must not stand in for the fast tier's.
            _row(EXACT.key, "single", [1000.0]), _row(EXACT.key, "batch16", [1.0])]
    by_name = {o.target.name: o for o in evaluate(rows)}
    assert set(FAST_TARGETS.values()) <= set(by_name)
    single = by_name[FAST_TARGETS["single"]]
    assert single.ratio == pytest.approx(1.25) and single.status == "met"
    batch = by_name[FAST_TARGETS["batch16"]]
    assert batch.ratio == pytest.approx(250 / 70) and batch.status == "missed"
    # The speculative variant is the numerator, not the fast tier's plain row (which is 1x).
    extractive = by_name[FAST_TARGETS["extractive"]]
    assert extractive.ratio == pytest.approx(70 / 30) and extractive.status == "met (busy)"
    assert by_name[FAST_TARGETS["ttft"]].status == "not measured"  # no TTFT rows at all
    # The existing exact-tier target still reads the exact tier's rows.
    assert by_name["16 concurrent: verispec >= 3x llama-cpp-python"].ratio == pytest.approx(1 / 70)


@pytest.mark.parametrize("fast_s, hf_s, ratio, status", [
    (0.8, 2.0, 0.4, "met"),  # 0.8 s against HF's 2 s: the time ratio shown is the one the target names
    (1.0, 2.0, 0.5, "met"),  # the bound itself is met
    (1.5, 2.0, 0.75, "missed"),  # faster than HF, still not twice as fast
    (3.0, 2.0, 1.5, "missed"),
])
def test_fast_ttft_target_is_a_time_ratio_where_lower_is_better(fast_s, hf_s, ratio, status):
    rows = [_row(FAST.key, "ttft", [1 / fast_s], metric=TTFT), _row("hf", "ttft", [1 / hf_s], metric=TTFT),
            _row(EXACT.key, "ttft", [1 / 4.0], metric=TTFT)]
    by_name = {o.target.name: o for o in evaluate(rows)}
    fast = by_name[FAST_TARGETS["ttft"]]
    assert fast.target.lower_is_better and fast.ratio == pytest.approx(ratio) and fast.status == status
    # The exact tier's TTFT target keeps its score ratio (HF time / verispec time, higher is better).
    exact = by_name["TTFT, 2k-token prompt: verispec <= HF"]
    assert not exact.target.lower_is_better and exact.ratio == pytest.approx(hf_s / 4.0) and exact.status == "missed"
    table = format_targets(list(by_name.values()), markdown=True)
    line = next(x for x in table.splitlines() if "verispec fast <=" in x)
    assert f"| {ratio:.2f}x | {status} |" in line


def test_fast_tier_rows_in_the_tables():
    exact = _row(EXACT.key, "single", [20.0], label=EXACT.label)
    exact.equal, exact.logprob_diff = "reference", 2e-5
    fast = _row(FAST.key, "single", [50.0], label=FAST.label)
    fast.equal, fast.logprob_diff = "no (0/1 ids, first diff at token 3)", 0.11
    lines = format_table([exact, fast], headline=headlines()).splitlines()
    assert lines[3].startswith(f"single    {FAST.label}")
    # verispec / system is the exact tier over the fast one; the logprob gap to HF is reported.
    assert "0.40x" in lines[3] and "1.1e-01" in lines[3] and "first diff at token 3" in lines[3]
    rows = [_row(EXACT.key, "ttft", [1 / 2.0], metric=TTFT, label=EXACT.label),
            _row(FAST.key, "ttft", [1 / 0.5], metric=TTFT, label=FAST.label)]
    ttft = format_ttft_table(rows, markdown=True).splitlines()
    assert ttft[3].startswith(f"| {FAST.label} | 2000 | 500 |") and "| 0.25x |" in ttft[3]


# ---------------------------------------------------------------------------------- fidelity
def _fid_row(kl: float, top1: float, label: str = FAST.label) -> FidelityRow:
    return FidelityRow(FAST.key, label, 16, 128, {"dtype": "bfloat16", "quantization": "gguf"},
                       Fidelity(2040, kl, top1, 0.125), 300.0)


def test_fidelity_sizes():
    assert fidelity_size(False) == FIDELITY_FULL == (16, 128)
    assert fidelity_size(True) == FIDELITY_QUICK
    prompts, tokens = FIDELITY_QUICK
    assert prompts * tokens <= 64  # --quick stays a smoke test: ~0.15 s per token


def test_fidelity_table_and_json():
    good, bad = _fid_row(1.5e-3, 0.975), _fid_row(3e-3, 0.99, label="other")
    lines = format_fidelity_table([good, bad]).splitlines()
    assert lines[0].split()[:2] == ["tier", "weights"] and "mean KL vs HF fp32" in lines[0]
    assert "KL <= 0.002" in lines[0] and "top-1 >= 97%" in lines[0]
    assert lines[2].startswith(FAST.label) and "bfloat16, gguf" in lines[2]
    assert "2040 (16 x 128)" in lines[2] and "1.50e-03" in lines[2] and "97.5%" in lines[2]
    assert "1.25e-01" in lines[2] and lines[2].endswith("yes")
    assert lines[3].endswith("no")  # KL above the bar, whatever the top-1 agreement
    md = format_fidelity_table([good], markdown=True).splitlines()
    assert md[0].startswith("| tier | weights | tokens |") and md[1].startswith("|---|")
    assert md[2] == (f"| {FAST.label} | bfloat16, gguf | 2040 (16 x 128) | 1.50e-03 | 97.5% | 1.25e-01 | yes |")
    assert format_fidelity_table([]) == ""
    doc = json.loads(json.dumps(good.to_json()))
    assert doc["meets_bar"] is True and doc["quantization"] == "gguf" and doc["tokens"] == 2040
    assert (doc["mean_kl"], doc["top1"], doc["kl_bar"], doc["top1_bar"]) == (1.5e-3, 0.975, 2e-3, 0.97)
    assert _fid_row(1e-3, 0.96).to_json()["meets_bar"] is False


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
    """A verispec tier (or, with `key`, a peer) that generates `token` over and over."""

    compare = "ids"

    def __init__(self, key: str = "verispec", token: int = 7) -> None:
        self.key, self.label, self.token = key, TIERS[key].label if key in TIERS else key, token
        self.calls: list[tuple[int, str, int | None]] = []

    def variant_label(self, variant: str) -> str:
        return self.label if variant == PLAIN else f"{self.label} + spec"

    def precision(self) -> dict:
        return {"dtype": "float32" if self.key == EXACT.key else "bfloat16", "quantization": None}

    def engines(self) -> dict:
        return {"none": self}

    def generate(self, prompts, max_tokens, variant=PLAIN, logprobs=None):
        self.calls.append((max_tokens, variant, logprobs))
        ids = [[self.token] * max_tokens for _ in prompts]
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
        return fake if key == EXACT.key else _FakeSystem(key)

    monkeypatch.setattr(runner, "load_system", load)
    cfg = runner._resolve(_args("--peers", "llamacpp", "--scenarios", "single,extractive,ttft", "--runs", "2",
                                "--max-tokens", "4"))
    prompt = Prompt("q", "q", [1, 2, 3])
    state = runner.RunState()
    assert runner._measure_all(cfg, "model.gguf", 2, None, {s: [prompt] for s in cfg.scenarios}, state)
    assert "pip install llama-cpp-python" in state.skipped["llamacpp"]
    rows = {(r.scenario, r.variant): r for r in state.results if r.system == EXACT.key}
    assert set(rows) == {("single", PLAIN), ("extractive", PLAIN), ("extractive", SPEC), ("ttft", PLAIN)}
    assert rows["ttft", PLAIN].tokens == [1, 1]  # TTFT always generates one token
    assert rows["extractive", SPEC].acceptance == pytest.approx(3.0)  # 12 tokens over 4 steps, 2 runs
    assert rows["extractive", SPEC].equal == "yes (ids)"
    exact_checks = [c.result.scenario for c in state.checks if c.result.system == EXACT.key]
    assert exact_checks == ["single", "extractive", "extractive"]
    assert (4, PLAIN, 1) in fake.calls  # the untimed logprob run


class _FakeHF(_FakeSystem):
    """HF's phase: a model to lend the fidelity check, and log_softmax 0.1 below the tiers'."""

    def __init__(self) -> None:
        super().__init__("hf")
        self.model = object()

    def token_logprobs(self, prompt_ids, gen_ids):
        return [-0.6] * len(gen_ids)


def test_both_tiers_run_as_their_own_systems_and_hf_checks_them(monkeypatch):
    exact, fast, hf = _FakeSystem(EXACT.key), _FakeSystem(FAST.key, token=8), _FakeHF()
    loaded: list[str] = []

    def load(key, *args):
        loaded.append(key)
        return {EXACT.key: exact, FAST.key: fast, "hf": hf}[key]

    sweeps, fidelity = [], []
    monkeypatch.setattr(runner, "load_system", load)
    monkeypatch.setattr(runner, "run_sweep", lambda *a: sweeps.append(a[-1]) or [])
    monkeypatch.setattr(runner, "measure_fidelity",
                        lambda model, tier, prompts, tokens, log: fidelity.append((model, tier, prompts, tokens))
                        or _fid_row(1e-3, 0.99))
    cfg = runner._resolve(_args("--quick", "--peers", "hf", "--max-tokens", "4",
                                "--scenarios", "single,batch16_logprobs,extractive,spec"))
    prompt = Prompt("q", "q", [1, 2, 3])
    state = runner.RunState(fidelity_prompts=[prompt, prompt])
    assert runner._measure_all(cfg, "model.gguf", 2, None, {s: [prompt] for s in cfg.scenarios}, state)
    assert loaded == [EXACT.key, FAST.key, "hf"]  # one system at a time, exact tier first
    rows = {(r.system, r.scenario, r.variant): r for r in state.results}
    assert {k for k in rows if k[0] == FAST.key} == {
        (FAST.key, "single", PLAIN), (FAST.key, "extractive", PLAIN), (FAST.key, "extractive", SPEC)}
    assert (EXACT.key, "batch16_logprobs", PLAIN) in rows  # logprobs=20 stays exact-tier only
    assert rows[FAST.key, "single", PLAIN].label == FAST.label
    assert rows[FAST.key, "extractive", SPEC].label == f"{FAST.label} + spec"
    # The exact tier is the reference; the fast tier's rows say whether they match it.
    assert rows[EXACT.key, "single", PLAIN].equal == "reference"
    assert rows[FAST.key, "single", PLAIN].equal == "no (0/1 ids, first diff at token 0)"
    assert rows["hf", "single", PLAIN].equal == "yes (ids)"  # HF's fake repeats the exact tier's token
    # HF checks both tiers' logprobs on the check_logprobs scenarios.
    assert sorted((c.result.system, c.result.scenario, c.result.variant) for c in state.checks) == sorted(
        (t, sc, v) for t in TIERS for sc, v in (("single", PLAIN), ("extractive", PLAIN), ("extractive", SPEC)))
    assert all(c.result.logprob_diff == pytest.approx(0.1) for c in state.checks)
    assert (4, PLAIN, 1) in fast.calls
    assert sweeps == [{"none": exact}]  # the speculative sweep stays on the exact tier
    assert state.precision == {EXACT.key: {"dtype": "float32", "quantization": None},
                               FAST.key: {"dtype": "bfloat16", "quantization": None}}
    # Fidelity: the fast tier, against HF's model, with --quick's size.
    assert fidelity == [(hf.model, FAST, [prompt, prompt], FIDELITY_QUICK[1])]
    assert len(state.fidelity) == 1 and not state.errors


def test_a_failed_fidelity_check_is_an_error_not_a_lost_run(monkeypatch):
    systems = {EXACT.key: _FakeSystem(EXACT.key), FAST.key: _FakeSystem(FAST.key), "hf": _FakeHF()}
    monkeypatch.setattr(runner, "load_system", lambda key, *a: systems[key])

    def broken(*args):
        raise RuntimeError("no int4 kernel")

    monkeypatch.setattr(runner, "measure_fidelity", broken)
    cfg = runner._resolve(_args("--peers", "hf", "--max-tokens", "2", "--runs", "1", "--scenarios", "single"))
    prompt = Prompt("q", "q", [1, 2, 3])
    state = runner.RunState(fidelity_prompts=[prompt])
    assert runner._measure_all(cfg, "model.gguf", 2, None, {"single": [prompt]}, state)
    assert "no int4 kernel" in state.errors["fidelity"] and set(state.errors) == {"fidelity"}
    assert all(c.result.logprob_diff is not None for c in state.checks)  # HF's checks still ran
    assert state.fidelity == []
    # Without HF among the peers there are no fidelity prompts and no check.
    state = runner.RunState()
    cfg = runner._resolve(_args("--peers", "none", "--max-tokens", "2", "--runs", "1", "--scenarios", "single"))
    assert runner._measure_all(cfg, "model.gguf", 2, None, {"single": [prompt]}, state)
    assert state.fidelity == [] and not state.errors and len(state.results) == 2


def test_a_fast_tier_that_fails_to_load_does_not_stop_the_bench(monkeypatch):
    def load(key, *args):
        if key == FAST.key:
            raise RuntimeError("int4 kernels unavailable")
        return _FakeSystem(key)

    monkeypatch.setattr(runner, "load_system", load)
    cfg = runner._resolve(_args("--peers", "none", "--max-tokens", "2", "--runs", "1", "--scenarios", "single"))
    state = runner.RunState()
    assert runner._measure_all(cfg, "model.gguf", 2, None, {"single": [Prompt("q", "q", [1])]}, state)
    assert "int4 kernels unavailable" in state.errors[FAST.key]
    assert [r.system for r in state.results] == [EXACT.key]


class _FakeLLM:
    """Stands in for verispec.LLM: records its keyword arguments, resolves dtype like the engine."""

    made: list[dict] = []

    def __init__(self, **kwargs) -> None:
        import torch

        _FakeLLM.made.append(kwargs)
        auto = kwargs.get("dtype") == "auto"

        class _Config:
            dtype = torch.bfloat16 if auto else torch.float32
            quantization = "gguf" if auto else None

        self.engine = type("Engine", (), {"config": _Config})()


def test_verispec_system_passes_each_tier_dtype_explicitly(monkeypatch):
    import verispec

    from benchmarks.peers import SPEC_K, VerispecSystem, load_system

    monkeypatch.setattr(verispec, "LLM", _FakeLLM)
    _FakeLLM.made = []
    fast = load_system(FAST.key, "model.gguf", 2, None, print)
    assert isinstance(fast, VerispecSystem) and (fast.key, fast.label) == (FAST.key, FAST.label)
    assert fast.variant_label(SPEC) == f"{FAST.label} + ngram k={SPEC_K}"
    assert fast.precision() == {"dtype": "bfloat16", "quantization": "gguf"}
    fast._engine(SPEC)
    exact = load_system(EXACT.key, "model.gguf", 2, None, print)
    assert (exact.key, exact.label, exact.variant_label(PLAIN)) == ("verispec", "verispec", "verispec")
    assert exact.precision() == {"dtype": "float32", "quantization": None}
    exact.engines()  # builds the exact tier's speculative engine for the sweep
    assert [m["dtype"] for m in _FakeLLM.made] == ["auto", "auto", "float32", "float32"]
    assert _FakeLLM.made[1]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": SPEC_K}
    assert _FakeLLM.made[3]["speculative_config"] == _FakeLLM.made[1]["speculative_config"]
    with pytest.raises(ValueError, match="verispec_fast"):
        load_system("vllm", "model.gguf", 2, None, print)


class _Built(Exception):
    pass


def test_the_sweeps_build_exact_tier_engines_whatever_llms_default(monkeypatch):
    import verispec

    from benchmarks.adaptive import run_adaptive
    from benchmarks.spec import run_sweep

    made: list[dict] = []

    def record(**kwargs):
        made.append(kwargs)
        raise _Built  # the first engine's arguments are all this test needs

    monkeypatch.setattr(verispec, "LLM", record)
    with pytest.raises(_Built):
        run_sweep(4, True, print)
    with pytest.raises(_Built):
        run_adaptive(4, 1, True, print)
    assert [m["dtype"] for m in made] == [EXACT.dtype, EXACT.dtype] == ["float32", "float32"]


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


def test_plot_gives_each_tier_its_own_colour_and_spec_a_lighter_shade(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from benchmarks.plot import plot

    saved = _saved_figures(monkeypatch)
    rows = [_row(EXACT.key, "extractive", [20.0], label=EXACT.label),
            _row(EXACT.key, "extractive", [30.0], variant=SPEC, label=f"{EXACT.label} + ngram"),
            _row(FAST.key, "extractive", [50.0], label=FAST.label),
            _row(FAST.key, "extractive", [90.0], variant=SPEC, label=f"{FAST.label} + ngram"),
            _row("llamacpp", "extractive", [60.0], label="llama.cpp")]
    plot(tmp_path / "b.png", rows, {"cpu": "test cpu", "torch_threads": 2}, 128)
    bars = saved[0].axes[0].patches
    assert [b.get_height() for b in bars] == pytest.approx([20.0, 30.0, 50.0, 90.0, 60.0])
    colours = [to_hex(b.get_facecolor()) for b in bars]
    assert len(set(colours)) == 5
    # tab20's pairs: blue / light blue for the exact tier, orange / light orange for the fast one.
    assert colours[:4] == ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78"]
    legend = [t.get_text() for t in saved[0].legends[0].get_texts()]
    assert legend == [r.label for r in rows]


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
