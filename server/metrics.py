"""Prometheus metrics of the api process: latencies as the client sees them, token counters, queue and KV."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hybrid.managers.messages import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        labels = ["model"]
        self.ttft = Histogram("hybridd_time_to_first_token_seconds", "Request arrival to first streamed token",
                              labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model)
        self.tpot = Histogram("hybridd_time_per_output_token_seconds", "Mean time per output token after the first",
                              labels, buckets=TOKEN_BUCKETS, registry=self.registry).labels(model)
        self.e2e = Histogram("hybridd_e2e_request_latency_seconds", "Request arrival to last token",
                             labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model)
        self.prompt_tokens = Counter("hybridd_prompt_tokens", "Prompt tokens of admitted requests",
                                     labels, registry=self.registry).labels(model)
        self.generation_tokens = Counter("hybridd_generation_tokens", "Generated tokens", labels,
                                         registry=self.registry).labels(model)
        self.prefix_queried = Counter("hybridd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=self.registry).labels(model)
        self.prefix_hits = Counter("hybridd_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache",
                                   labels, registry=self.registry).labels(model)
        self._finished = Counter("hybridd_requests", "Requests by outcome (stop, length, abort, error, rejected)",
                                 ["model", "outcome"], registry=self.registry)
        self.model = model
        self.queue_depth = Gauge("hybridd_queue_depth", "Requests admitted by the api and not finished",
                                 labels, registry=self.registry).labels(model)
        self.running = Gauge("hybridd_num_requests_running", "Requests in the engine's running batch", labels,
                             registry=self.registry).labels(model)
        self.waiting = Gauge("hybridd_num_requests_waiting", "Requests waiting in the engine", labels,
                             registry=self.registry).labels(model)
        self.kv_usage = Gauge("hybridd_kv_cache_usage_ratio", "Share of KV-cache blocks in use", labels,
                              registry=self.registry).labels(model)
        self.engine_up = Gauge("hybridd_engine_up", "1 while the engine is ready", labels,
                               registry=self.registry).labels(model)

    def finished(self, outcome: str) -> None:
        self._finished.labels(self.model, outcome).inc()

    def render(self, engine_stats: EngineStats | None, pending: int, engine_ready: bool) -> bytes:
        self.queue_depth.set(pending)
        self.engine_up.set(1 if engine_ready else 0)
        if engine_stats is not None:
            self.running.set(engine_stats.running)
            self.waiting.set(engine_stats.waiting)
            self.kv_usage.set(engine_stats.kv_blocks_used / max(engine_stats.kv_blocks_total, 1))
        return generate_latest(self.registry)
