"""The benchmark's systems (both verispec tiers, the peers), their plots and its JSON report."""

from __future__ import annotations

import builtins
import json

import pytest

from benchmarks import runner
from benchmarks.options import resolve
from benchmarks.system import PLAIN, SPEC, Generation, PeerUnavailable
from benchmarks.prompts import Prompt
from benchmarks.report import (
    TTFT,
)
from benchmarks.scenarios import headlines
from benchmarks.tiers import (
    EXACT,
    FAST,
    FIDELITY_QUICK,
    TIERS,
)

from bench_helpers import bench_args, bench_row, fidelity_row, saved_figures


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
    cfg = resolve(bench_args("--peers", "llamacpp", "--scenarios", "single,extractive,ttft", "--runs", "2",
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
                        or fidelity_row(1e-3, 0.99))
    cfg = resolve(bench_args("--quick", "--peers", "hf", "--max-tokens", "4",
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
    cfg = resolve(bench_args("--peers", "hf", "--max-tokens", "2", "--runs", "1", "--scenarios", "single"))
    prompt = Prompt("q", "q", [1, 2, 3])
    state = runner.RunState(fidelity_prompts=[prompt])
    assert runner._measure_all(cfg, "model.gguf", 2, None, {"single": [prompt]}, state)
    assert "no int4 kernel" in state.errors["fidelity"] and set(state.errors) == {"fidelity"}
    assert all(c.result.logprob_diff is not None for c in state.checks)  # HF's checks still ran
    assert state.fidelity == []
    # Without HF among the peers there are no fidelity prompts and no check.
    state = runner.RunState()
    cfg = resolve(bench_args("--peers", "none", "--max-tokens", "2", "--runs", "1", "--scenarios", "single"))
    assert runner._measure_all(cfg, "model.gguf", 2, None, {"single": [prompt]}, state)
    assert state.fidelity == [] and not state.errors and len(state.results) == 2


def test_a_fast_tier_that_fails_to_load_does_not_stop_the_bench(monkeypatch):
    def load(key, *args):
        if key == FAST.key:
            raise RuntimeError("int4 kernels unavailable")
        return _FakeSystem(key)

    monkeypatch.setattr(runner, "load_system", load)
    cfg = resolve(bench_args("--peers", "none", "--max-tokens", "2", "--runs", "1", "--scenarios", "single"))
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

    from benchmarks.peers import VerispecSystem, load_system
    from benchmarks.system import SPEC_K

    monkeypatch.setattr(verispec, "LLM", _FakeLLM)
    _FakeLLM.made = []
    fast = load_system(FAST.key, "model.gguf", 2, None, print)
    assert isinstance(fast, VerispecSystem) and (fast.key, fast.label) == (FAST.key, FAST.label)
    assert fast.variant_label(SPEC) == f"{FAST.label} + ngram k={SPEC_K} adaptive"
    assert fast.precision() == {"dtype": "bfloat16", "quantization": "gguf"}
    fast._engine(SPEC)
    exact = load_system(EXACT.key, "model.gguf", 2, None, print)
    assert (exact.key, exact.label, exact.variant_label(PLAIN)) == ("verispec", "verispec", "verispec")
    assert exact.precision() == {"dtype": "float32", "quantization": None}
    exact.engines()  # builds the exact tier's speculative engine for the sweep
    assert [m["dtype"] for m in _FakeLLM.made] == ["auto", "auto", "float32", "float32"]
    # The fast tier verifies adaptively (its verify rows cost more), the exact tier with fixed k.
    ngram = {"method": "ngram", "num_speculative_tokens": SPEC_K}
    assert _FakeLLM.made[1]["speculative_config"] == dict(ngram, adaptive_verification=True)
    assert _FakeLLM.made[3]["speculative_config"] == dict(ngram, adaptive_verification=False)
    assert exact.variant_label(SPEC) == f"verispec + ngram k={SPEC_K}"
    with pytest.raises(ValueError, match="verispec_fast"):
        load_system("vllm", "model.gguf", 2, None, print)


class _Built(Exception):
    pass


def test_the_sweeps_name_their_tier_whatever_llms_default(monkeypatch):
    """The speculative sweep runs the exact tier, the adaptive sweep the fast (default) one whose
    cost curve adaptive verification is tuned on; both pass dtype explicitly."""
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
    assert [m["dtype"] for m in made] == [EXACT.dtype, FAST.dtype] == ["float32", "auto"]


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


def test_plot_draws_the_medians_the_busy_hatch_and_a_ttft_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from benchmarks.plot import plot

    saved = saved_figures(monkeypatch)
    rows = [bench_row("verispec", "single", [20.0, 22.0, 30.0]), bench_row("hf", "single", [10.0], load=0.9),
            bench_row("verispec", "ttft", [0.5], metric=TTFT)]
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

    saved = saved_figures(monkeypatch)
    rows = [bench_row(EXACT.key, "extractive", [20.0], label=EXACT.label),
            bench_row(EXACT.key, "extractive", [30.0], variant=SPEC, label=f"{EXACT.label} + ngram"),
            bench_row(FAST.key, "extractive", [50.0], label=FAST.label),
            bench_row(FAST.key, "extractive", [90.0], variant=SPEC, label=f"{FAST.label} + ngram"),
            bench_row("llamacpp", "extractive", [60.0], label="llama.cpp")]
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

    rows = [bench_row("verispec", "single", [20.0]), bench_row("hf", "single", [10.0])]
    write_json(tmp_path / "b.json", {"machine": {}}, rows, headlines())
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["ratios_verispec_over_row"] == {"single": {"hf": 2.0}}
    assert doc["results"][0]["tok_s_median"] == pytest.approx(20.0)
