"""Prometheus metrics of one gateway instance (its own registry: two apps in one process,
as in tests, never share counters).

Request-level metrics are recorded by the gateway as answers flow; engine-level figures
(queue depth, running sequences, KV blocks, prefix cache, acceptance by draft position) are
read from `EngineClient.stats()` at scrape time by a custom collector. Routing skew per MoE
layer and phase comes from the attention worker's latest `RoutingSummary` (sent in a
StepResult every few steps), under `stats["routing_summary"]`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)


class _EngineStatsCollector:
    def __init__(self, read_stats: Callable[[], dict]) -> None:
        self._read_stats = read_stats

    def collect(self):
        stats = self._read_stats() or {}
        for key, name, doc in (
            ("num_waiting", "moemesh_queue_depth", "Requests waiting to be scheduled."),
            ("num_running", "moemesh_running_sequences", "Sequences being generated."),
        ):
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, name, doc in (
            ("kv_blocks_used", "moemesh_kv_blocks_used", "KV cache blocks in use, per tier."),
            ("kv_blocks_total", "moemesh_kv_blocks_total", "KV cache blocks, per tier."),
            ("kv_snapshots_used", "moemesh_kv_snapshots_used",
             "Resume snapshots held by requests (where each resumes after a preemption), per tier."),
            ("kv_snapshots_cached", "moemesh_kv_snapshots_cached",
             "Resume snapshots the prefix cache keeps (where a hit can resume), per tier."),
            ("kv_snapshots_total", "moemesh_kv_snapshots_total", "Resume snapshots, per tier."),
        ):
            if key in stats:
                family = GaugeMetricFamily(name, doc, labels=["tier"])
                for tier, count in sorted(stats[key].items()):
                    family.add_metric([tier], count)
                yield family
        for key, name, doc in (
            ("prefix_cache_queried_tokens", "moemesh_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hit_tokens", "moemesh_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
        ):
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])
        if "preemptions" in stats:
            family = CounterMetricFamily("moemesh_preemptions", "Sequences preempted for KV blocks, by how they come "
                                         "back: swap (blocks to the CPU tier) or recompute.", labels=["mode"])
            for mode, count in sorted(stats["preemptions"].items()):
                family.add_metric([mode], count)
            yield family
        drafts = stats.get("spec_draft_by_position")
        accepted = stats.get("spec_accepted_by_position")
        if drafts is not None and accepted is not None:
            draft_family = CounterMetricFamily("moemesh_spec_position_draft_tokens", "Draft tokens proposed, by draft position.", labels=["position"])
            accepted_family = CounterMetricFamily("moemesh_spec_position_accepted_tokens", "Draft tokens accepted, by draft position.", labels=["position"])
            rate_family = GaugeMetricFamily("moemesh_spec_acceptance_rate", "Accepted / proposed, by draft position.", labels=["position"])
            for position, (num_draft, num_accepted) in enumerate(zip(drafts, accepted)):
                draft_family.add_metric([str(position)], num_draft)
                accepted_family.add_metric([str(position)], num_accepted)
                rate_family.add_metric([str(position)], num_accepted / num_draft if num_draft else 0.0)
            yield from (draft_family, accepted_family, rate_family)
        summary = stats.get("routing_summary")
        if summary is not None:
            yield from _routing_families(summary)


_ROUTING_GAUGES = (
    ("max_over_mean", "moemesh_routing_max_over_mean",
     "Hottest expert's activations / mean activations per expert, by MoE layer and phase (1 = uniform)."),
    ("top8_share", "moemesh_routing_top8_share", "Share of activations that went to the 8 hottest experts."),
    ("effective_experts", "moemesh_routing_effective_experts",
     "exp(entropy) of the per-expert activation counts (n_routed_experts = uniform, 1 = one expert)."),
    ("num_unused", "moemesh_routing_unused_experts", "Experts never selected so far."),
)


def _routing_families(summary):
    """Per-layer skew gauges from a RoutingSummary (counts since the attention worker started)."""
    activations = CounterMetricFamily("moemesh_routing_activations", "Routed (token, expert) activations, by MoE "
                                      "layer and phase.", labels=["layer", "phase"])
    gauges = [(field, GaugeMetricFamily(name, doc, labels=["layer", "phase"])) for field, name, doc in _ROUTING_GAUGES]
    for entry in summary.layers:
        labels = [str(entry.layer), str(entry.phase.value if hasattr(entry.phase, "value") else entry.phase)]
        activations.add_metric(labels, entry.num_activations)
        for field, family in gauges:
            family.add_metric(labels, getattr(entry, field))
    yield GaugeMetricFamily("moemesh_routing_summary_steps", "Attention worker steps covered by the routing summary.",
                            value=summary.num_steps)
    yield activations
    yield from (family for _, family in gauges)


class _WeightBytesCollector:
    """`moemesh_worker_weight_bytes{worker,device,kind}`: what each worker's weights occupy on its device
    (kind="resident") and what the same tensors take in the checkpoint (kind="stored")."""

    def __init__(self, read_records: Callable[[], list[dict]]) -> None:
        self.read_records = read_records

    def collect(self):
        family = GaugeMetricFamily("moemesh_worker_weight_bytes", "Weight bytes each worker holds: resident on its "
                                   "device and stored in the checkpoint.", labels=["worker", "device", "kind"])
        for record in self.read_records():
            for kind in ("resident", "stored"):
                family.add_metric([record["name"], record["device"], kind], record[f"{kind}_bytes"])
        yield family


class RouterMetrics:
    def __init__(self, read_engine_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moemesh_requests", "HTTP generation requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=r)
        self.time_to_first_token = Histogram("moemesh_time_to_first_token_seconds", "Arrival to first token, per choice.",
                                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram("moemesh_inter_token_latency_seconds", "Time between tokens of a choice.",
                                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("moemesh_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("moemesh_generation_tokens", "Generated tokens (rate() gives tokens/s).", registry=r)
        self.cached_prompt_tokens = Counter("moemesh_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=r)
        self.spec_draft_tokens = Counter("moemesh_spec_draft_tokens", "Draft tokens verified.", registry=r)
        self.spec_accepted_tokens = Counter("moemesh_spec_accepted_tokens", "Draft tokens accepted.", registry=r)
        r.register(_EngineStatsCollector(read_engine_stats))

    def watch_weight_bytes(self, read_records: Callable[[], list[dict]]) -> None:
        """Export every worker's weight bytes from `read_records()` (see `_WeightBytesCollector`)."""
        self.registry.register(_WeightBytesCollector(read_records))

    def render(self) -> bytes:
        return generate_latest(self.registry)
