"""The neighbour benchmark's pieces that run without timing anything: the busy process it starts
and stops, and the table's ratios against one quiet thread of the same system."""

from __future__ import annotations

import time

from benchmarks.neighbour import NeighbourRow, busy_neighbour, format_neighbour


def test_the_neighbour_spins_while_the_block_runs_and_is_gone_after():
    import os

    with busy_neighbour(True) as proc:
        time.sleep(0.5)
        with open(f"/proc/{proc.pid}/stat") as f:
            user_ticks = int(f.read().rsplit(")", 1)[1].split()[11])
        assert user_ticks / os.sysconf("SC_CLK_TCK") > 0.1  # it spins
    assert proc.poll() is not None  # stopped and reaped
    with busy_neighbour(False) as none:
        assert none is None


def test_the_table_reads_each_row_against_one_quiet_thread_of_its_system():
    rows = [NeighbourRow("verispec", 1, False, 50.0), NeighbourRow("verispec", 2, True, 45.0),
            NeighbourRow("verispec (threads fixed)", 2, True, 20.0), NeighbourRow("llama-bench", 1, False, 60.0),
            NeighbourRow("llama-bench", 2, True, 30.0)]
    table = format_neighbour(rows).splitlines()
    assert table[3] == "| verispec | 2 | yes | 45.0 | 0.90x |"
    assert table[4] == "| verispec (threads fixed) | 2 | yes | 20.0 | 0.40x |"
    assert table[6] == "| llama-bench | 2 | yes | 30.0 | 0.50x |"
