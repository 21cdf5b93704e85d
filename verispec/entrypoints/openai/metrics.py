"""Prometheus metrics of the server (GET /metrics), through prometheus_client.

Latency histograms and request counters are measured in the frontend. Engine state (KV cache use,
queue lengths, preemptions, speculative decoding counters) is whatever the core reported last: the
core sends its stats with every output message, and a custom collector exposes that snapshot.
With data parallelism the snapshot is the replicas' sum (dp_client.sum_stats: counters over all
replicas, gauges over live ones), and `verispec:dp_replica_*` series carry each replica's routing.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from verispec.engine.core_protocol import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class _EngineCollector:
    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def describe(self):  # collected on scrape; describing would run collect at registration
        return []

    # long: one metric family per EngineStats field, a line or two each, in the struct's order.
    def collect(self):
        s: EngineStats = self.metrics.engine_stats
        model = self.metrics.model_name

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(f"verispec:{name}", doc, labels=["model_name"])
            g.add_metric([model], value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(f"verispec:{name}", doc, labels=["model_name"])
            c.add_metric([model], value)
            return c

        def counter_by_index(name: str, doc: str, label: str, values: list[int]):
            """One counter per list index (draft position, capacity), labelled with the index."""
            c = CounterMetricFamily(f"verispec:{name}", doc, labels=["model_name", label])
            for i, value in enumerate(values):
                c.add_metric([model, str(i)], value)
            return c

        if self.metrics.runtime:
            names = sorted(self.metrics.runtime)
            info = GaugeMetricFamily("verispec:runtime_info", "What the engine runs on (always 1): precision tier, "
                                     "CPU capability, kernels, compiled or eager step.", labels=["model_name", *names])
            info.add_metric([model, *(self.metrics.runtime[n] for n in names)], 1.0)
            yield info
        version = GaugeMetricFamily("verispec:weight_version_info", "The weights served now (always 1): the version "
                                    "given to update_weights, or the number of updates.", labels=["model_name", "weight_version"])
        version.add_metric([model, str(s.weight_version)], 1.0)
        yield version
        yield counter("weight_updates", "In-place weight updates applied.", s.num_weight_updates)
        used = s.kv_blocks_total - s.kv_blocks_free
        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                    used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield gauge("kv_cache_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield gauge("kv_cache_blocks_free", "KV cache blocks free.", s.kv_blocks_free)
        yield gauge("engine_core_alive", "1 while the engine-core process runs.", 0.0 if self.metrics.core_dead else 1.0)
        yield counter("num_preemptions", "Requests preempted (recomputed later) for KV space.", s.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", s.num_steps)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield gauge("prefix_cache_hit_rate", "Prefix cache hits / queries since start (0 before any query).",
                    s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        yield counter("prefix_cache_prompt_rows_hits", "Prompt-logprob rows read from the prefix cache.",
                      s.prefix_cache_prompt_rows_hits)
        yield counter("spec_decode_num_drafts", "Verify steps of a request that carried drafts.", s.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens)
        yield counter_by_index("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
                               "position", s.accepted_per_position)
        replicas = self.metrics.replicas() if self.metrics.replicas is not None else []
        if replicas:  # data parallelism: the frontend's view of each replica
            alive = GaugeMetricFamily("verispec:dp_replica_alive", "1 while the replica's engine core runs.",
                                      labels=["model_name", "dp_rank"])
            in_flight = GaugeMetricFamily("verispec:dp_replica_num_requests_in_flight",
                                          "Requests routed to the replica and not finished.",
                                          labels=["model_name", "dp_rank"])
            routed = CounterMetricFamily("verispec:dp_replica_requests_routed", "Requests routed to the replica.",
                                         labels=["model_name", "dp_rank"])
            hits = CounterMetricFamily("verispec:dp_replica_prefix_hits",
                                       "Requests routed where a block of their prompt was remembered.",
                                       labels=["model_name", "dp_rank"])
            for r in replicas:
                rank = str(r.dp_rank)
                alive.add_metric([model, rank], 1.0 if r.alive else 0.0)
                in_flight.add_metric([model, rank], r.in_flight)
                routed.add_metric([model, rank], r.routed)
                hits.add_metric([model, rank], r.prefix_hits)
            yield from (alive, in_flight, routed, hits)
        if s.adaptive_capacity_histogram:  # adaptive verification is on
            yield counter("spec_decode_adaptive_budget_tokens", "Draft tokens the host budgeted (sum of B).",
                          s.adaptive_budget_tokens)
            yield counter("spec_decode_adaptive_drafted_tokens", "Draft tokens run through the forward.",
                          s.adaptive_drafted_tokens)
            yield counter("spec_decode_adaptive_admitted_tokens", "Draft tokens admitted to verification.",
                          s.adaptive_admitted_tokens)
            yield counter_by_index("spec_decode_adaptive_capacity", "Request-steps by drafts verified (capacity).",
                                   "capacity", s.adaptive_capacity_histogram)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engine_stats = EngineStats()
        self.core_dead = False
        self.runtime: dict[str, str] = {}  # RuntimeInfo.labels() from the core's ready message
        # With data parallelism: () -> per-replica `ReplicaInfo`s (engine/dp_client.py).
        self.replicas = None
        # A registry per server, not the global one: tests build several apps in one process.
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.requests = Counter("verispec:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.http_errors = Counter("verispec:request_errors", "Requests answered with an error, by HTTP status.",
                                   ["model_name", "status"], registry=self.registry)
        self.prompt_tokens = Counter("verispec:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("verispec:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry).labels(model_name)
        self.ttft = Histogram("verispec:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("verispec:inter_token_latency_seconds",
                             "Time between two outputs of a request (one engine step; several tokens when "
                             "drafts are accepted).", labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)
        self.e2e = Histogram("verispec:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.registry.register(_EngineCollector(self))

    def update_engine(self, stats: EngineStats) -> None:
        self.engine_stats = stats

    def observe_latency(self, ttft: float | None, itl: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def finish_request(self, reason: str, seconds: float, prompt_tokens: int) -> None:
        self.requests.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(seconds)

    def error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()
