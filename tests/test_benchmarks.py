"""benchmarks (python -m benchmarks): the pure parts (options, ratios, tables, targets, peer skipping), no model, no timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import runner
from benchmarks.options import resolve
from benchmarks.system import PLAIN, SPEC, Generation, acceptance_from_lengths
from benchmarks.prompts import extractive_prompt, long_prompt
from benchmarks.report import (
    TTFT,
    format_table,
    format_ttft_table,
    ratios,
)
from benchmarks.scenarios import SCENARIOS, compare, headlines, max_abs_diff
from benchmarks.targets import TARGETS, evaluate, format_targets
from benchmarks.tiers import (
    EXACT,
    FAST,
    FIDELITY_FULL,
    FIDELITY_QUICK,
    fidelity_size,
    format_fidelity_table,
)
from bench_helpers import bench_args, bench_row, fidelity_row


# ---------------------------------------------------------------------------------- options
def test_defaults_and_quick():
    full = resolve(bench_args())
    assert (full.max_tokens, full.runs, full.quick) == (128, 3, False)
    assert full.peers == ["hf", "llamacpp"]
    assert full.scenarios == ["single", "batch16", "batch16_logprobs", "extractive", "ttft", "spec", "adaptive", "prefix", "structured", "tp", "cost", "weights", "suffix", "dspark", "neighbour"]
    quick = resolve(bench_args("--quick", "--out", "x"))
    assert (quick.max_tokens, quick.runs, quick.out) == (32, 1, Path("x"))


def test_explicit_values_win_over_quick_and_none_means_no_peers():
    cfg = resolve(bench_args("--quick", "--max-tokens", "7", "--runs", "2", "--peers", "none",
                                "--scenarios", "ttft, extractive,ttft", "--threads", "1"))
    assert (cfg.max_tokens, cfg.runs, cfg.peers, cfg.threads) == (7, 2, [], 1)
    assert cfg.scenarios == ["ttft", "extractive"]  # order kept, duplicates dropped
    assert cfg.adaptive_queue == 1 and resolve(bench_args("--adaptive-queue", "3")).adaptive_queue == 3


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
        resolve(bench_args(*argv))


def test_bad_option_exits_2_without_loading_anything(capsys):
    assert runner.run(bench_args("--peers", "vllm")) == 2
    assert "unknown peer" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- ratios
def test_ratios_use_the_headline_variant_and_invert_ttft():
    rows = [
        bench_row("verispec", "extractive", [20.0]),
        bench_row("verispec", "extractive", [40.0], variant=SPEC),
        bench_row("llamacpp", "extractive", [50.0]),
        bench_row("verispec", "ttft", [1 / 2.0], metric=TTFT),  # 2 s to the first token
        bench_row("hf", "ttft", [1 / 3.0], metric=TTFT),  # 3 s
    ]
    rel = ratios(rows, headlines())
    assert rel["extractive"] == pytest.approx({"verispec": 2.0, "llamacpp": 0.8})
    # HF takes 1.5x verispec's time to the first token: >1 means verispec is better, as elsewhere.
    assert rel["ttft"] == pytest.approx({"hf": 1.5})
    assert "verispec + spec" not in rel["extractive"]  # the headline is not compared with itself


def test_median_min_max_and_acceptance():
    r = bench_row("verispec", "single", [10.0, 30.0, 20.0], variant=SPEC)
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
    a = bench_row("verispec", "extractive", [20.0], label="verispec")
    a.equal, a.logprob_diff = "reference", 1.5e-5
    b = bench_row("verispec", "extractive", [40.0], variant=SPEC, label="verispec + ngram k=5")
    b.equal, b.spec_steps, b.spec_tokens = "yes (ids)", 4, 14
    c = bench_row("hf", "extractive", [10.0], label="HF transformers", load=0.9)
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
    rows = [bench_row("verispec", "ttft", [1 / 2.0], metric=TTFT, label="verispec"),
            bench_row("hf", "ttft", [1 / 4.0], metric=TTFT, label="HF transformers")]
    text = format_ttft_table(rows)
    assert "2000" in text and "4000" in text and "2.00x" in text and "1000" in text  # 2000 tok / 2 s
    assert format_table(rows).count("\n") == 1  # TTFT rows stay out of the tok/s table
    assert format_ttft_table(rows[:0]) == ""


# ---------------------------------------------------------------------------------- targets
def test_targets_met_missed_busy_and_not_measured():
    rows = [bench_row("verispec", "single", [21.0]), bench_row("hf", "single", [10.0]),
            bench_row("verispec", "batch16", [100.0]), bench_row("hf", "batch16", [50.0], load=0.8),
            bench_row("verispec", "ttft", [1.0], metric=TTFT), bench_row("hf", "ttft", [0.5], metric=TTFT)]
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
    "single": "single stream chat: verispec fast >= 1.5x llama-cpp-python plain",
    "batch16": "16 concurrent: verispec fast >= 5x llama-cpp-python",
    "extractive": "extractive: verispec fast best drafter >= 3.5x llama-cpp-python plain",
    "speculation": "extractive: verispec fast best drafter >= 1.8x verispec fast plain",
    "ttft": "TTFT, 2k-token prompt: verispec fast <= 0.5x HF fp32 (time ratio, lower is better)",
}


def test_fast_tier_targets_compare_its_own_rows_with_the_peers():
    rows = [bench_row(FAST.key, "single", [48.0]), bench_row("llamacpp", "single", [32.0]),
            bench_row(FAST.key, "batch16", [250.0]), bench_row("llamacpp", "batch16", [70.0]),
            bench_row(FAST.key, "extractive", [30.0]), bench_row(FAST.key, "extractive", [70.0], variant=SPEC),
            bench_row("llamacpp", "extractive", [30.0], load=0.9),
            # The exact tier's rows must not stand in for the fast tier's.
            bench_row(EXACT.key, "single", [1000.0]), bench_row(EXACT.key, "batch16", [1.0])]
    by_name = {o.target.name: o for o in evaluate(rows)}
    assert set(FAST_TARGETS.values()) <= set(by_name)
    single = by_name[FAST_TARGETS["single"]]
    assert single.ratio == pytest.approx(1.5) and single.status == "met"
    batch = by_name[FAST_TARGETS["batch16"]]
    assert batch.ratio == pytest.approx(250 / 70) and batch.status == "missed"
    # The speculative variant is the numerator, not the fast tier's plain row (which is 1x).
    extractive = by_name[FAST_TARGETS["extractive"]]
    assert extractive.ratio == pytest.approx(70 / 30) and extractive.status == "missed (busy)"
    # Speculation's own gain: the tier's speculative row over its plain row.
    speculation = by_name[FAST_TARGETS["speculation"]]
    assert speculation.ratio == pytest.approx(70 / 30) and speculation.status == "met"
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
    rows = [bench_row(FAST.key, "ttft", [1 / fast_s], metric=TTFT), bench_row("hf", "ttft", [1 / hf_s], metric=TTFT),
            bench_row(EXACT.key, "ttft", [1 / 4.0], metric=TTFT)]
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
    exact = bench_row(EXACT.key, "single", [20.0], label=EXACT.label)
    exact.equal, exact.logprob_diff = "reference", 2e-5
    fast = bench_row(FAST.key, "single", [50.0], label=FAST.label)
    fast.equal, fast.logprob_diff = "no (0/1 ids, first diff at token 3)", 0.11
    lines = format_table([exact, fast], headline=headlines()).splitlines()
    assert lines[3].startswith(f"single    {FAST.label}")
    # verispec / system is the exact tier over the fast one; the logprob gap to HF is reported.
    assert "0.40x" in lines[3] and "1.1e-01" in lines[3] and "first diff at token 3" in lines[3]
    rows = [bench_row(EXACT.key, "ttft", [1 / 2.0], metric=TTFT, label=EXACT.label),
            bench_row(FAST.key, "ttft", [1 / 0.5], metric=TTFT, label=FAST.label)]
    ttft = format_ttft_table(rows, markdown=True).splitlines()
    assert ttft[3].startswith(f"| {FAST.label} | 2000 | 500 |") and "| 0.25x |" in ttft[3]


# ---------------------------------------------------------------------------------- fidelity
def test_fidelity_sizes():
    assert fidelity_size(False) == FIDELITY_FULL == (16, 128)
    assert fidelity_size(True) == FIDELITY_QUICK
    prompts, tokens = FIDELITY_QUICK
    assert prompts * tokens <= 64  # --quick stays a smoke test: ~0.15 s per token


def test_fidelity_table_and_json():
    good, bad = fidelity_row(1.5e-3, 0.975), fidelity_row(3e-3, 0.99, label="other")
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
    assert fidelity_row(1e-3, 0.96).to_json()["meets_bar"] is False


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


def test_scaling_table_ratio_and_files(tmp_path):
    from benchmarks.scaling import ScalingRow, format_scaling_table, write_scaling

    row = ScalingRow("exact fp32", 1, 35.0, 40.0, 80.0, 137.3, 96.0, 2.25, 0.3)
    assert row.ratio == pytest.approx(2.0)
    table = format_scaling_table([row])
    assert "| exact fp32 | 1 | 35.0 | 40.0 | 80.0 | 2.00x | 137 | 96 | 2.2 | 0.3 |" in table
    write_scaling(tmp_path, {"cpu": "test cpu", "torch_threads": 2}, [row])
    assert {p.name for p in tmp_path.iterdir()} == {"scaling.md", "scaling.json", "scaling.png"}


def test_the_cost_curve_table_gives_each_step_against_one_row_and_the_verify_target():
    from benchmarks.cost_curve import CONFIGS, LONG_CONTEXT, ROWS, BareRow, CostCurve, CurveRow, format_curve, long_label

    packed, other = CONFIGS[0][0], CONFIGS[1][0]
    rows = [CurveRow(packed, n, 4.0 + 0.2 * (n - 1)) for n in ROWS]
    rows += [CurveRow(other, n, 8.0 * n) for n in ROWS]
    bare = [BareRow("avx512_vnni", n, 3.0, 30.0, 100.0) for n in ROWS]
    bare += [BareRow("avx2", n, 2.0 + n, 10.0, 50.0) for n in ROWS]
    table = format_curve(CostCurve(rows, bare))
    assert f"| {packed} | 4.00 ms (1.00x)" in table and "| 1.25x |" in table  # 5.0 / 4.0 at 6 rows
    assert f"| {other} | 8.00 ms (1.00x)" in table and "| 6.00x |" in table
    # The steps' variant in full, then every variant's milliseconds and its 6-row ratio.
    assert "Bare packed matmul loop" in table and table.count("| 3.00 | 30.0 | 100.0 |") == len(ROWS)
    assert "| 10.0 | 50.0 |" not in table
    assert "| avx512_vnni | 3.00 | 3.00 | 3.00 | 3.00 | 3.00 | 3.00 | 1.00x |" in table
    assert "| avx2 | 3.00 | 4.00 | 6.00 | 8.00 | 10.00 | 18.00 | 2.67x |" in table
    assert table.endswith("1.25x, met")
    # The fast tier over a long context: its own row, and its ratio under the target line.
    rows += [CurveRow(long_label(packed), n, 5.0 + 0.4 * (n - 1), context=LONG_CONTEXT) for n in ROWS]
    table = format_curve(CostCurve(rows, []))
    assert f"| {long_label(packed)} | 5.00 ms (1.00x)" in table  # 7.0 / 5.0 at 6 rows
    assert "Bare packed" not in table
    assert table.endswith(f"1.25x, met\nOver a {LONG_CONTEXT}-token context: 1.40x")


def test_the_weights_table_says_whether_each_tier_met_its_bound(tmp_path):
    from benchmarks.weights import WeightsRow, write_weights

    rows = [WeightsRow("exact", 272, 0.2, 12.0, 1.0), WeightsRow("fast", 272, 3.5, 6.0, 3.0)]
    md = write_weights(tmp_path, {"cpu": "x"}, rows)
    assert "| exact | 272 | 0.20 s | 12.0 s | < 1 s | yes |" in md and "| fast | 272 | 3.50 s | 6.0 s | < 3 s | NO |" in md
    assert (tmp_path / "weights.json").exists()


def test_suffix_workloads_answer_tool_calls_and_read_the_standard_library():
    from benchmarks.workloads import code_edit_messages, tool_result

    weather = json.loads(tool_result('Sure: {"name": "get_weather", "arguments": {"city": "Oslo"}}'))
    assert weather["city"] == "Oslo" and weather == json.loads(tool_result('{"name": "get_weather", "arguments": {"city": "Oslo"}}'))
    assert "error" in json.loads(tool_result("no call here")) and "error" in json.loads(tool_result('{"name": "x"}'))
    messages = code_edit_messages(8)
    assert len(messages) == 8 and all("def " in m[0]["content"] for m in messages)


def test_suffix_targets_read_the_rows_ratios():
    from benchmarks.suffix import SuffixRow, format_suffix, targets

    rows = []
    for tier in ("exact", "fast"):
        for w in ("agent", "code_edit", "rl"):
            for variant, tok_s in (("plain", 10.0), ("ngram", 12.0), ("suffix", 24.0), ("suffix+adaptive", 9.0)):
                rows.append(SuffixRow(tier, w, variant, tokens=[int(tok_s * 10)], seconds=[10.0], drafts=4, accepted=8,
                                      steps=20, drafting_steps=0 if variant == "plain" else 5,
                                      drafter_s=0.2 if variant.startswith("suffix") else 0.0))
    found = {t.name: t for t in targets(rows)}
    assert found["exact agent: suffix / ngram"].ratio == 2.0 and found["exact agent: suffix / ngram"].met
    assert not found["fast rl: suffix+adaptive / plain"].met  # 0.9x < 0.97x
    assert found["exact rl suffix: drafter host time / wall (batch 16)"].ratio == pytest.approx(0.02)
    table = format_suffix(rows)
    assert "| exact | agent | suffix | 24.0 | 2.40x | 3.00 | 25% |" in table and "NO" in table


def test_drafting_steps_count_adaptive_ones_else_every_step_of_a_drafting_engine():
    from benchmarks.report import drafting_steps

    before = {"num_steps": 10, "num_drafts": 4, "adaptive": {"drafting_steps": 2}}
    after = {"num_steps": 30, "num_drafts": 9, "adaptive": {"drafting_steps": 5}}
    assert drafting_steps(before, after) == 3
    assert drafting_steps({"num_steps": 10, "num_drafts": 4}, {"num_steps": 30, "num_drafts": 9}) == 20
    assert drafting_steps({"num_steps": 10}, {"num_steps": 30}) == 0  # plain


def test_dspark_table_and_targets_read_the_rows():
    from benchmarks.dspark import DSparkRow, _mark_identical, format_dspark, targets

    rows = []
    for variant, speed in (("plain", 10.0), ("ngram+adaptive", 11.0), ("suffix+adaptive", 10.5), ("dspark", 16.0),
                           ("dspark+adaptive", 19.0)):
        for mode in ("greedy", "T=0.8"):
            for batch in (1, 16):
                out = [[1, 2, 3]] if variant != "dspark" or batch == 1 else [[1, 2, 4]]
                rows.append(DSparkRow(variant, mode, batch, tokens=int(speed * 10), seconds=10.0, drafts=10,
                                      accepted=25 if variant.startswith("dspark") else 5, outputs=out,
                                      steps=40, drafting_steps=10 if variant != "plain" else 0))
    _mark_identical(rows)
    calibration = [{"confidence": "0.9-1.0", "drafts": 40, "predicted": 0.93, "accepted": 0.88},
                   {"confidence": "0.0-0.1", "drafts": 3, "predicted": 0.05, "accepted": 0.9}]  # too few: not judged
    results = {"rows": rows, "calibration": calibration,
               "extractive": {"plain": 30.0, "ngram+adaptive": 50.0, "suffix+adaptive": 45.0, "dspark": 40.0,
                              "dspark+adaptive": 55.0},
               "extractive_drafted": {"plain": 0.0, "ngram+adaptive": 0.9, "suffix+adaptive": 0.8, "dspark": 1.0,
                                      "dspark+adaptive": 0.5}}
    found = {t["target"]: t for t in targets(results)}
    assert found["batch 1, greedy: dspark+adaptive / plain >= 1.8"] == {
        "target": "batch 1, greedy: dspark+adaptive / plain >= 1.8", "value": 1.9, "met": True}
    assert found["mean acceptance length (greedy, batch 1) >= 3"]["value"] == 3.5
    assert found["calibration per tenth (>= 20 drafts) within 0.1"]["met"]
    assert found["extractive: best drafter with dspark no slower than without"]["value"] == 1.1
    table = format_dspark(results)
    assert "| dspark | greedy | 16 | 16.0 | 1.60x | 3.50 | 25% | NO |" in table and "| T=0.8 | 1 |" in table
    assert "| 0.9-1.0 | 40 | 0.93 | 0.88 |" in table
    assert "| dspark+adaptive | 55.0 | 1.83x | 50% |" in table
    worst = found["open chat: every drafter + adaptive / plain >= 0.97"]
    assert worst["value"] == 1.05 and worst["met"]  # suffix + adaptive, 10.5 against 10


def test_training_plot_reads_a_loss_log(tmp_path):
    import json

    from benchmarks.dspark import plot_training

    log = tmp_path / "loss.jsonl"
    lines = [{"step": s, "loss": 3.0 / s} | ({"held_out_loss": 3.1 / s, "held_out_top1": 0.1 * s,
                                              "held_out_accept": 0.05 * s} if s % 2 == 0 else {})
             for s in range(1, 7)]
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    plot_training(log, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000
