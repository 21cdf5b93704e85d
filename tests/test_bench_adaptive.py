"""The adaptive verification sweep's pool, summary, tables and plot."""

from __future__ import annotations


import pytest

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

from bench_helpers import saved_figures


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
            _arow(1, ADAPTIVE, [40.0]),
            _arow(4, "none", [50.0]), _arow(4, "k=1", [60.0]), _arow(4, "k=6", [45.0]), _arow(4, ADAPTIVE, [66.0])]
    assert rows[2].tok_s == pytest.approx(40.0)  # median of the runs
    s1, s4 = summarize(rows)
    assert (s1.batch_size, s1.best_fixed, s1.ratio, s1.beats_all) == (1, "k=6", pytest.approx(1.0), False)
    assert (s4.best_fixed, s4.ratio, s4.beats_all) == ("k=1", pytest.approx(1.1), True)
    assert target_met([s1, s4])  # >= 1.0x everywhere and ahead at batch 4
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
    assert "1.0x the best fixed k" in text
    ok = format_summary(summarize([_arow(4, "k=1", [60.0]), _arow(4, ADAPTIVE, [75.0])]))
    assert ok.endswith("**met**.")


def test_adaptive_plot_draws_one_line_per_configuration(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from benchmarks.adaptive import plot_adaptive

    saved = saved_figures(monkeypatch)
    rows = [_arow(b, c, [10.0 * b + i]) for b in (1, 4) for i, c in enumerate(("none", "k=1", ADAPTIVE))]
    plot_adaptive(tmp_path / "a.png", rows)
    lines = {line.get_label(): line for line in saved[0].axes[0].get_lines()}
    assert list(lines) == ["none", "k=1", ADAPTIVE]
    assert list(lines["k=1"].get_xdata()) == [1, 4] and list(lines["k=1"].get_ydata()) == pytest.approx([11.0, 41.0])
    assert lines[ADAPTIVE].get_linewidth() == 2.5 and lines["none"].get_linestyle() == "--"
    assert (tmp_path / "a.png").stat().st_size > 10_000
