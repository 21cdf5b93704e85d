"""The cores an engine's ops run on: how many this process may use, and how many of them the
machine leaves it, step by step.

- **May use**: the CPUs in the process's affinity, capped by its cgroup's CPU quota (a container
  limited to 2 CPUs on a 64-core host gets 2 threads, not 64: more threads than the quota only
  queue behind each other at every parallel region's barrier).
- **Left to it**: every parallel region of a step (a few hundred per decode step) ends at a
  barrier that waits for its slowest thread. Beside another busy process, a thread of ours is
  descheduled for a scheduler slice now and then, and the whole region waits for it: on a 2-core
  VM, two threads beside one busy process of the same priority decoded at 0.40x of one quiet
  thread, while one thread beside it ran at its quiet speed. So the engine runs on the cores the
  others leave: `BusyMeter` reads what the others use of this process's CPUs (/proc/stat, less
  this process's own CPU time), and `ThreadGovernor` sets torch's thread count before each step.
  A kernel build of verispec's own that runs beside holds a core too (models/cpu_kernels.py).

The ops' results never depend on the thread count (each output element is computed by one
thread, whole), so a change of count between steps changes only the speed.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from verispec import envs

# How long a window the meter averages the others' use over: long enough for /proc/stat's 10 ms
# ticks, short enough that a neighbour's start costs a few steps only.
METER_SECONDS = 0.25
# A core counts as the others' once they use half of it; it is given back once they use less than
# a quarter of it (no flapping while a neighbour's use hovers near a half).
TAKE, GIVE_BACK = 0.5, 0.25


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the process's cgroup may use (its quota over its period), or None without a limit."""
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def affinity() -> frozenset[int]:
    """The CPUs this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def available_cores(quota: float | None = None, cpus: frozenset[int] | None = None) -> int:
    """Threads worth running: the CPUs in the affinity, capped by the cgroup's quota (rounded up:
    a quota of 1.5 CPUs runs two threads three quarters of the time)."""
    cpus = affinity() if cpus is None else cpus
    quota = _cgroup_quota() if quota is None else quota
    count = len(cpus) or 1
    return max(1, min(count, math.ceil(quota))) if quota else count


def _busy_seconds(cpus: frozenset[int], stat: Path = Path("/proc/stat"), niced: bool = False) -> float | None:
    """Seconds the given CPUs have spent busy since boot, or None where /proc/stat cannot be read.
    Steal counts (a core the host takes is not ours either); niced time does not: a niced process
    yields to ours and runs on what we leave (on a 2-core VM, two threads beside a nice-19 busy
    loop decoded at 0.90x of two quiet ones, one thread at 0.79x). `niced`: this process is
    niced itself, so niced time is its own or its peers'."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        if not line.startswith("cpu") or line[3:4] == " ":
            continue
        name, *values = line.split()
        if int(name[3:]) in cpus:
            ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(ticks) - (0 if niced else ticks[1]) - ticks[3] - ticks[4]
    return busy / tick


@dataclass(slots=True)
class BusyMeter:
    """How many of `cpus` the other processes keep busy, averaged over windows of METER_SECONDS:
    the CPUs' busy time less this process's own CPU time."""

    cpus: frozenset[int]
    window: float = METER_SECONDS
    niced: bool = field(default_factory=lambda: hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) > 0)
    _last: tuple[float, float, float] | None = field(default=None, init=False)  # wall, busy, own

    def sample(self, now: float | None = None) -> float | None:
        """The others' busy cores over the window just ended, or None while it lasts."""
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last[0] < self.window:
            return None
        busy, own = _busy_seconds(self.cpus, niced=self.niced), time.process_time()
        if busy is None:
            return None
        last, self._last = self._last, (now, busy, own)
        if last is None:
            return None
        return max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])


@dataclass(slots=True)
class ThreadGovernor:
    """One engine thread's op thread count: its full count, less a core for a kernel build beside
    it, less the cores the other processes keep busy (`conceded`)."""

    full: int
    meter: BusyMeter | None
    conceded: int = 0

    def want(self, build_running: bool, others: float | None) -> int:
        """The thread count for the next step, given the others' busy cores (None: no new measure)."""
        if others is not None:
            if others + TAKE >= self.conceded + 1:  # another core taken, or more
                self.conceded = min(self.full - 1, int(others + TAKE))
            elif others < self.conceded - 1 + GIVE_BACK:  # a core given back, or more
                self.conceded = max(0, int(others + 1 - GIVE_BACK))
        # A build of our own beside is one of the others too, once measured: not counted twice.
        return max(1, self.full - max(int(build_running), self.conceded))


_governors: dict[int, ThreadGovernor] = {}
_lock = threading.Lock()


def govern_threads(build_running: bool = False, start: bool = False) -> int:
    """Called on the thread that runs an engine's ops, as it starts (`start`) and before each step:
    sets that thread's torch thread count to what the machine leaves it, and returns it. The count
    the thread has at an engine's start (else at its first call) is its full count: torch's thread
    count belongs to the thread that sets it. `envs.adaptive_threads()` off keeps the full count
    beside busy neighbours (a kernel build of verispec's own still takes a core)."""
    import torch  # here: `verispec serve` sizes its replicas (available_cores) before torch loads

    ident = threading.get_ident()
    with _lock:
        governor = None if start else _governors.get(ident)
        if governor is None:
            meter = BusyMeter(affinity(), METER_SECONDS) if envs.adaptive_threads() else None
            governor = _governors[ident] = ThreadGovernor(torch.get_num_threads(), meter)
    others = governor.meter.sample() if governor.meter is not None and governor.full > 1 else None
    want = governor.want(build_running, others)
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    return want


def full_threads() -> int:
    """This thread's full count: what it had before a governor lowered it, else torch's count. A
    new engine on a thread an earlier one had lowered (beside a neighbour) starts from it."""
    import torch

    governor = _governors.get(threading.get_ident())
    return governor.full if governor is not None else torch.get_num_threads()
