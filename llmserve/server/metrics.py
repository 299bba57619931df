"""The server's Prometheus metrics: one registry per app, read from the engine after each step."""

from __future__ import annotations


class ServerMetrics:
    """Prometheus metrics in a registry of their own (several apps may live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.running = Gauge("llmserve_num_requests_running", "Requests with a slot", registry=r)
        self.waiting = Gauge("llmserve_num_requests_waiting", "Requests queued, not yet started",
                             registry=r)
        self.kv_pages_used = Gauge("llmserve_kv_pages_used", "KV pages held by sequences",
                                   registry=r)
        self.kv_pages_total = Gauge("llmserve_kv_pages_total", "Usable KV pages", registry=r)
        self.prefix_hit_rate = Gauge("llmserve_prefix_cache_hit_rate",
                                     "Prompt pages served by the prefix cache", registry=r)
        self.spec_acceptance = Gauge("llmserve_spec_decode_acceptance_rate",
                                     "Accepted / proposed draft tokens", registry=r)
        self.preemptions = Counter("llmserve_preemptions", "Sequences preempted", registry=r)
        self.generated = Counter("llmserve_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("llmserve_prompt_tokens", "Prompt tokens", registry=r)
        self.finished = Counter("llmserve_requests_finished", "Requests ended",
                                ["finish_reason"], registry=r)
        buckets = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
        self.ttft = Histogram("llmserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=buckets, registry=r)
        self.itl = Histogram("llmserve_inter_token_latency_seconds", "Between output tokens",
                             buckets=buckets, registry=r)
        self.e2e = Histogram("llmserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=buckets, registry=r)
        self._seen = {"preemptions": 0, "generated_tokens": 0}

    def update_engine(self, engine, running: int, waiting: int) -> None:
        """Reads the engine's counters (called on the engine thread after each step)."""
        self.running.set(running)
        self.waiting.set(waiting)
        blocks = engine.blocks
        self.kv_pages_total.set(blocks.num_pages - 1)
        self.kv_pages_used.set(blocks.num_pages - 1 - blocks.num_free_pages)
        st = blocks.stats
        if st.prefix_hits + st.prefix_misses:
            self.prefix_hit_rate.set(st.prefix_hits / (st.prefix_hits + st.prefix_misses))
        if getattr(engine, "spec", None) is not None:
            rate = engine.spec_metrics().get("acceptance_rate")
            if rate is not None:
                self.spec_acceptance.set(rate)
        self._count(self.preemptions, engine.stats, "preemptions")
        self._count(self.generated, engine.stats, "generated_tokens")

    def _count(self, counter, stats: dict, key: str) -> None:
        now = int(stats.get(key, 0))
        if now > self._seen[key]:
            counter.inc(now - self._seen[key])
        self._seen[key] = now
