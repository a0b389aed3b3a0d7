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
        by_role = ["model", "role"]  # role: engine, or prefill / decode when disaggregated
        self.running = Gauge("hybridd_num_requests_running", "Requests in the engine's running batch", by_role,
                             registry=self.registry)
        self.waiting = Gauge("hybridd_num_requests_waiting", "Requests waiting in the engine", by_role,
                             registry=self.registry)
        self.handoffs = Gauge("hybridd_num_requests_handing_off", "Prefilled requests between the prefill and "
                              "the decode engine (counted by each side)", by_role, registry=self.registry)
        self.handoffs_moved = Gauge("hybridd_kv_handoffs", "Sequences handed from the prefill to the decode engine "
                                    "since it started: put by the prefill side, taken over by the decode side",
                                    by_role, registry=self.registry)
        self.handoff_seconds = Gauge("hybridd_kv_handoff_seconds", "Time those hand-offs took on each side (prefill: "
                                     "gathering and putting the KV; decode: getting it and adopting the sequence)",
                                     by_role, registry=self.registry)
        self.kv_usage = Gauge("hybridd_kv_cache_usage_ratio", "Share of KV-cache blocks in use", by_role,
                              registry=self.registry)
        self.slp_passes = Gauge("hybridd_slp_passes", "Prefill passes that streamed their experts to the device",
                                by_role, registry=self.registry)
        self.slp_bytes = Gauge("hybridd_slp_streamed_bytes", "Expert bytes streamed to the device by prefill passes",
                               by_role, registry=self.registry)
        self.slp_rate = Gauge("hybridd_slp_streamed_gb_per_s", "Streamed expert bytes per second of streamed passes",
                              by_role, registry=self.registry)
        self.engine_up = Gauge("hybridd_engine_up", "1 while the engine is ready", labels,
                               registry=self.registry).labels(model)

    def finished(self, outcome: str) -> None:
        self._finished.labels(self.model, outcome).inc()

    def render(self, engine_stats: dict[str, EngineStats | None], pending: int, engine_ready: bool) -> bytes:
        """engine_stats: the latest stats of each engine role."""
        self.queue_depth.set(pending)
        self.engine_up.set(1 if engine_ready else 0)
        for role, stats in engine_stats.items():
            if stats is not None:
                self.running.labels(self.model, role).set(stats.running)
                self.waiting.labels(self.model, role).set(stats.waiting)
                self.handoffs.labels(self.model, role).set(stats.handoffs)
                if role in ("prefill", "decode"):
                    self.handoffs_moved.labels(self.model, role).set(stats.handoffs_moved)
                    self.handoff_seconds.labels(self.model, role).set(stats.handoff_seconds)
                self.kv_usage.labels(self.model, role).set(stats.kv_blocks_used / max(stats.kv_blocks_total, 1))
                if stats.slp is not None:
                    self.slp_passes.labels(self.model, role).set(stats.slp["passes"])
                    self.slp_bytes.labels(self.model, role).set(stats.slp["streamed_bytes"])
                    self.slp_rate.labels(self.model, role).set(stats.slp["gb_per_s"])
        return generate_latest(self.registry)
