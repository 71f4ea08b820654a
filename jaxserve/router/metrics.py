"""The router's Prometheus metrics, all named jaxserve_router_*, in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxserve.server.metrics import LATENCY_BUCKETS


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jaxserve_router_requests", "Requests forwarded, by replica", ["replica"], registry=r)
        self.prompt_tokens = Counter(
            "jaxserve_router_prompt_tokens", "Prompt tokens forwarded, by replica", ["replica"], registry=r
        )
        self.predicted_hit_tokens = Counter(
            "jaxserve_router_predicted_hit_tokens",
            "Prompt tokens the router expected cached where it sent them (device, host tier or pending)",
            ["replica"],
            registry=r,
        )
        self.hit_tokens = Counter(
            "jaxserve_router_prefix_hit_tokens",
            "Prompt tokens the replicas found cached (their num_cached_tokens)",
            ["replica"],
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "jaxserve_router_predicted_ttft_seconds",
            "Time to first token the policy predicted for the replica it chose",
            ["replica"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.observed_ttft = Histogram(
            "jaxserve_router_observed_ttft_seconds",
            "Time to first token seen by the router, from forwarding to the first message",
            ["replica"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.resends = Counter(
            "jaxserve_router_resends",
            "Requests sent again to another replica before their first token, by reason",
            ["reason"],
            registry=r,
        )
        self.broken_streams = Counter(
            "jaxserve_router_broken_streams",
            "Streams ended UNAVAILABLE because their replica failed after the first token",
            ["replica"],
            registry=r,
        )
        self.rejected = Counter(
            "jaxserve_router_rejected_requests",
            "Requests refused by the router, by gRPC status",
            ["status"],
            registry=r,
        )
        self.replica_up = Gauge(
            "jaxserve_router_replica_up",
            "1 when the replica takes requests (subscribed to its page events and healthy)",
            ["replica"],
            registry=r,
        )
        self.resubscribes = Counter(
            "jaxserve_router_resubscribes", "Page event subscriptions restarted after a gap", ["replica"], registry=r
        )
        self.page_events = Counter(
            "jaxserve_router_page_events",
            "Page events received (after snapshots): pages stored and removed, per tier",
            ["replica", "kind", "tier"],
            registry=r,
        )
        self.in_flight = Gauge("jaxserve_router_streams_in_flight", "Streams being forwarded", registry=r)
