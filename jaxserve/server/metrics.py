"""Prometheus metrics, all named jaxserve_*, in a registry of their own (one per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "jaxserve_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "jaxserve_rejected_requests", "Requests refused, by gRPC status", ["status"], registry=r
        )
        self.idle_streams_expired = Counter(
            "jaxserve_idle_streams_expired",
            "Streams aborted because their client stopped reading for longer than server.stream_idle_timeout",
            registry=r,
        )
        self.streams_in_flight = Gauge(
            "jaxserve_streams_in_flight",
            "Generate calls holding an in-flight slot (running, waiting, or finished but not yet read)",
            registry=r,
        )
        self.running = Gauge("jaxserve_running_requests", "Sequences running", registry=r)
        self.waiting = Gauge("jaxserve_waiting_requests", "Sequences waiting for a slot", registry=r)
        self.kv_pages_used = Gauge("jaxserve_kv_pages_used", "KV pages held by sequences", registry=r)
        self.kv_pages_total = Gauge("jaxserve_kv_pages_total", "Usable KV pages", registry=r)
        self.kv_usage = Gauge("jaxserve_kv_cache_usage_ratio", "Fraction of KV pages held", registry=r)
        self.prefix_hit_rate = Gauge(
            "jaxserve_prefix_cache_hit_rate", "Prompt tokens served from the cache", registry=r
        )
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "jaxserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "jaxserve_inter_token_latency_seconds",
            "Time between a stream's tokens (a message of several tokens: its wait shared among them)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jaxserve_request_latency_seconds", "Request end-to-end latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.compiles_after_warmup = Gauge(
            "jaxserve_compiles_after_warmup", "Executables compiled while serving", registry=r
        )
        self.preemptions = Gauge("jaxserve_preemptions", "Sequences preempted so far", registry=r)
        self.handover_gauges: dict[str, Gauge] | None = None  # registered on a decode replica (engine.role)
        self.expert_gauges: dict[str, Gauge] | None = None  # registered with a mixture-of-experts model's stats
        self.speculation_gauges: dict[str, Gauge] | None = None  # registered when the engine speculates
        self.request_acceptance = Histogram(
            "jaxserve_spec_decode_request_acceptance_rate",
            "Per finished sequence that had proposals: accepted proposed tokens over proposed ones",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )

    def _register_expert_gauges(self) -> dict[str, Gauge]:
        r = self.registry
        return {
            "expert_load_max_over_mean": Gauge(
                "jaxserve_expert_load_max_over_mean",
                "Tokens routed to the busiest expert over the mean expert, all layers",
                registry=r,
            ),
            "expert_device_tokens": Gauge(
                "jaxserve_expert_device_tokens",
                "Routed tokens computed on each device (expert parallelism)",
                ["device"],
                registry=r,
            ),
            "expert_device_imbalance": Gauge(
                "jaxserve_expert_device_imbalance",
                "Busiest device's routed tokens over the mean device's, summed over layers (expert parallelism)",
                registry=r,
            ),
            "expert_rebalances": Gauge(
                "jaxserve_expert_rebalances", "Times experts were moved between devices", registry=r
            ),
        }

    def _observe_speculation(self, stats: dict) -> None:
        if self.speculation_gauges is None:
            r = self.registry
            described = {
                "speculative_num_draft_tokens": "Tokens proposed for speculative verification so far",
                "speculative_num_accepted_tokens": "Proposed tokens the target model accepted so far",
                "speculative_num_verify_rows": "Decode rows that verified proposals so far",
                "speculative_acceptance_rate": "Accepted proposed tokens over proposed ones, all requests",
                "speculative_mean_accepted_length": "Tokens a verify row emits on average (accepted + 1)",
            }
            self.speculation_gauges = {
                name: Gauge(
                    "jaxserve_spec_decode_" + name.removeprefix("speculative_num_").removeprefix("speculative_"),
                    text,
                    registry=r,
                )
                for name, text in described.items()
            }
        for name, gauge in self.speculation_gauges.items():
            gauge.set(stats[name])

    def _observe_handovers(self, stats: dict) -> None:
        if self.handover_gauges is None:
            r = self.registry
            self.handover_gauges = {
                "handover_local_prefills": Gauge(
                    "jaxserve_handover_local_prefills",
                    "Requests a decode replica prefilled itself: their wait for a free slot timed out",
                    registry=r,
                ),
                "handover_queued": Gauge(
                    "jaxserve_handover_queued", "Handovers waiting for a free slot on a decode replica", registry=r
                ),
            }
        for name, gauge in self.handover_gauges.items():
            gauge.set(stats[name])

    def observe_engine(self, stats: dict) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        used = stats["kv_pages_total"] - stats["kv_pages_free"]
        self.kv_pages_used.set(used)
        self.kv_pages_total.set(stats["kv_pages_total"])
        self.kv_usage.set(used / max(stats["kv_pages_total"], 1))
        self.prefix_hit_rate.set(stats["prefix_cache_hit_rate"])
        self.compiles_after_warmup.set(stats["num_compiles_after_warmup"])
        self.preemptions.set(stats["num_preemptions"])
        if "handover_local_prefills" in stats:
            self._observe_handovers(stats)
        if "speculative_num_draft_tokens" in stats:
            self._observe_speculation(stats)
        if "expert_load_max_over_mean" not in stats:
            return
        if self.expert_gauges is None:
            self.expert_gauges = self._register_expert_gauges()
        gauges = self.expert_gauges
        gauges["expert_load_max_over_mean"].set(stats["expert_load_max_over_mean"])
        if "expert_device_tokens" in stats:
            for device, tokens in enumerate(stats["expert_device_tokens"]):
                gauges["expert_device_tokens"].labels(device=str(device)).set(tokens)
            gauges["expert_device_imbalance"].set(stats["expert_device_imbalance"])
            gauges["expert_rebalances"].set(stats["expert_rebalances"])
