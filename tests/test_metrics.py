"""The server's Prometheus metrics (entrypoints/openai/metrics.py) from an EngineStats snapshot."""

from __future__ import annotations

from prometheus_client import generate_latest

from verispec.engine.core_protocol import EngineStats
from verispec.entrypoints.openai.metrics import ServerMetrics


def test_metrics_label_per_position_and_per_capacity_counters():
    metrics = ServerMetrics("m")
    metrics.engine_stats = EngineStats(accepted_per_position=[3, 1], adaptive_capacity_histogram=[0, 2, 5])
    text = generate_latest(metrics.registry).decode()
    assert 'verispec:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert 'verispec:spec_decode_adaptive_capacity_total{capacity="2",model_name="m"} 5.0' in text
    # Off (an empty histogram): no adaptive series at all.
    metrics.engine_stats = EngineStats()
    assert "adaptive" not in generate_latest(metrics.registry).decode()
