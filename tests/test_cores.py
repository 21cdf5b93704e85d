"""The cores an engine's ops run on (verispec/cores.py): the process's share of the machine, the
others' use of it, and the thread count that follows, down to an engine beside a busy process."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from verispec import cores, envs
from verispec.cores import BusyMeter, ThreadGovernor, available_cores


def test_the_cores_are_the_affinity_capped_by_the_cgroup_quota(tmp_path):
    assert available_cores(quota=None, cpus=frozenset(range(8))) == 8 or cores._cgroup_quota() is not None
    assert available_cores(quota=2.0, cpus=frozenset(range(64))) == 2  # a container of 2 CPUs on 64
    assert available_cores(quota=1.5, cpus=frozenset(range(4))) == 2  # rounded up
    assert available_cores(quota=16.0, cpus=frozenset({3, 5})) == 2  # the affinity is the cap
    assert available_cores(quota=0.2, cpus=frozenset({0})) == 1
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cores._cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cores._cgroup_quota(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cores._cgroup_quota(v1) == 3.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cores._cgroup_quota(v1) is None


def test_busy_time_counts_this_process_cpus_without_idle_or_niced_time(tmp_path):
    import os

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  900 900 900 900 900 0 0 0 0 0\n"
                    "cpu0 100 50 20 500 30 1 2 3 0 0\n"
                    "cpu1 200 60 10 400 10 0 0 7 0 0\n"
                    "cpu2 999 999 999 999 999 999 999 999 0 0\n"
                    "intr 12345\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert cores._busy_seconds(frozenset({0, 1}), stat) == pytest.approx((100 + 20 + 1 + 2 + 3 + 200 + 10 + 7) / tick)
    assert cores._busy_seconds(frozenset({1}), stat, niced=True) == pytest.approx((200 + 60 + 10 + 7) / tick)
    assert cores._busy_seconds(frozenset({0}), tmp_path / "absent") is None


def test_the_meter_reports_the_others_use_once_per_window(monkeypatch):
    busy, own = [10.0], [3.0]
    monkeypatch.setattr(cores, "_busy_seconds", lambda cpus, niced=False: busy[0])
    monkeypatch.setattr(cores.time, "process_time", lambda: own[0])
    meter = BusyMeter(frozenset({0, 1}), window=0.25, niced=False)
    assert meter.sample(now=100.0) is None  # the first window starts
    busy[0], own[0] = 11.5, 4.0  # 1.5 s busy in 1 s, 1 s of it this process's
    assert meter.sample(now=100.1) is None  # the window lasts
    assert meter.sample(now=101.0) == pytest.approx(0.5)
    busy[0], own[0] = 12.0, 4.6  # this process used more than the CPUs' busy time (rounding)
    assert meter.sample(now=102.0) == 0.0


def test_a_core_is_conceded_at_half_busy_and_given_back_below_a_quarter():
    gov = ThreadGovernor(full=4, meter=None)
    assert gov.want(False, None) == 4
    assert gov.want(False, 0.4) == 4  # less than half a core: nothing conceded
    assert gov.want(False, 0.6) == 3
    assert gov.want(False, 0.4) == 3  # hovering: kept
    assert gov.want(False, 1.7) == 2
    assert gov.want(False, 1.3) == 2
    assert gov.want(False, 1.1) == 3  # a core back
    assert gov.want(False, 0.1) == 4
    assert gov.want(False, 9.0) == 1  # never below one thread
    assert ThreadGovernor(full=2, meter=None).want(True, None) == 1  # a build of our own beside
    both = ThreadGovernor(full=4, meter=None)
    assert both.want(True, 1.0) == 3  # the build, once measured, is not counted twice


@pytest.mark.skipif(len(cores.affinity()) < 2, reason="one CPU: an engine has no thread to give up")
def test_an_engine_beside_a_busy_process_runs_on_the_core_it_leaves(monkeypatch, tiny_llama):
    """Two threads beside one busy process of the same priority wait at every parallel region for
    a descheduled thread (0.40x of one quiet thread on a 2-core VM): the engine drops to one
    thread while the neighbour runs, and takes both back once it has gone. Outputs are the same
    whatever the count."""
    from verispec import LLM, SamplingParams

    monkeypatch.setenv(envs.ADAPTIVE_THREADS, "1")
    monkeypatch.setattr(cores, "METER_SECONDS", 0.1)
    threads = torch.get_num_threads()
    llm = LLM(tiny_llama, max_model_len=512, num_threads=2)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    seen: list[int] = []
    step = llm.engine.step

    def counted():
        out = step()
        seen.append(torch.get_num_threads())
        return out

    monkeypatch.setattr(llm.engine, "step", counted)
    try:
        quiet = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert seen[-1] == 2
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            seen.clear()
            busy = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            neighbour.kill()
            neighbour.wait()
        assert 1 in seen and seen[-1] == 1
        assert busy == quiet
        time.sleep(0.3)
        seen.clear()
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert seen[-1] == 2  # given back
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)


def test_a_new_engine_starts_from_the_full_count_not_a_lowered_one():
    """An engine beside a neighbour lowered its thread's count; the next engine on that thread
    (no num_threads given) sizes itself from the full count."""
    from types import SimpleNamespace

    from verispec.cores import full_threads, govern_threads
    from verispec.distributed.executor import rank_threads

    threads = torch.get_num_threads()
    try:
        govern_threads(start=True)
        governor = cores._governors[threading.get_ident()]
        governor.conceded = threads - 1  # as beside a neighbour
        assert govern_threads() == 1 and torch.get_num_threads() == 1
        assert full_threads() == threads
        assert rank_threads(SimpleNamespace(num_threads=None, tensor_parallel_size=1)) == min(threads, available_cores())
    finally:
        cores._governors.pop(threading.get_ident(), None)
        torch.set_num_threads(threads)
