"""What crosses between the server's frontend and the engine core (engine/core_protocol.py)."""

from __future__ import annotations

import msgspec

from verispec.engine.core_protocol import EngineStats


def test_engine_stats_as_llm_stats_derives_the_ratios_and_shows_adaptive_only_when_on():
    stats = EngineStats(kv_blocks_total=8, kv_blocks_free=6, num_drafts=4, num_accepted_tokens=6,
                        prefix_cache_queries=10, prefix_cache_hits=4)
    d = stats.as_dict()
    assert d["kv_cache_usage"] == 0.25 and d["mean_acceptance_length"] == 2.5 and d["prefix_cache_hit_rate"] == 0.4
    assert "adaptive" not in d and EngineStats().as_dict()["mean_acceptance_length"] == 0.0
    tenths = [[0, 0.0, 0]] * 9 + [[4, 3.8, 3]]
    on = EngineStats(adaptive_steps=2, adaptive_admitted_tokens=5, adaptive_capacity_histogram=[1, 2, 0],
                     adaptive_calibration=tenths, adaptive_drafting_steps=1, adaptive_probes=1)
    calibration = on.as_dict()["adaptive"].pop("calibration")
    assert on.as_dict()["adaptive"] | {"calibration": None} == {
        "num_steps": 2, "budget_total": 0, "drafted_total": 0, "admitted_total": 5, "mean_admitted_per_step": 2.5,
        "drafting_steps": 1, "probes": 1, "capacity_histogram": [1, 2, 0], "calibration": None}
    assert calibration[0] == {"confidence": "0.0-0.1", "drafts": 0, "predicted": None, "accepted": None}
    assert calibration[9] == {"confidence": "0.9-1.0", "drafts": 4, "predicted": 0.95, "accepted": 0.75}
    # The snapshot crosses the process boundary whole.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(on), type=EngineStats)
    assert again == on
