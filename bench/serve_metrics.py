"""Serving metrics from per-request records, defined as `vllm bench serve` defines them.

- TTFT: send -> first streamed event with choices.
- TPOT per request: (e2e latency - TTFT) / (output tokens - 1), requests with >= 2 tokens.
- ITL: every gap between consecutive output events, pooled over all requests.
- E2EL: send -> `[DONE]`.
- Throughputs divide by the benchmark duration (first send -> last completion): completed
  requests, output tokens and input + output tokens per second.
- Goodput: completed requests that meet every given SLO, per second. A request with one
  output token has no TPOT and meets any TPOT limit.
Only completed requests enter the distributions and token totals; failures are counted.
Percentiles interpolate linearly between order statistics (numpy's default; bench.timing.percentile).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from moemesh.bench.serve_client import RequestRecord
from moemesh.bench.timing import percentile

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
NUM_ERRORS_KEPT = 5
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class SloLimits:
    """Service-level objectives in milliseconds; None: that metric is not limited."""

    max_ttft_ms: float | None = None
    max_tpot_ms: float | None = None
    max_e2el_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(limit is not None for limit in (self.max_ttft_ms, self.max_tpot_ms, self.max_e2el_ms))

    def met_by(self, record: RequestRecord) -> bool:
        checks = ((self.max_ttft_ms, record.ttft_s), (self.max_tpot_ms, record.tpot_s),
                  (self.max_e2el_ms, record.e2el_s))
        return record.success and all(
            limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)

    def to_json(self) -> dict:
        return {"ttft_ms": self.max_ttft_ms, "tpot_ms": self.max_tpot_ms, "e2el_ms": self.max_e2el_ms}


def parse_goodput(items: Sequence[str]) -> SloLimits:
    """`["ttft:500", "tpot:50"]` -> SloLimits (milliseconds, each > 0, each name once)."""
    limits: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"goodput limit {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}")
        if name in limits:
            raise ValueError(f"goodput limit {name!r} given twice")
        try:
            limit_ms = float(value)
        except ValueError:
            raise ValueError(f"goodput limit {item!r}: {value!r} is not a number") from None
        if not limit_ms > 0 or math.isinf(limit_ms):
            raise ValueError(f"goodput limit {item!r}: must be a positive number of milliseconds")
        limits[name] = limit_ms
    return SloLimits(limits.get("ttft"), limits.get("tpot"), limits.get("e2el"))


def parse_percentiles(text: str) -> tuple[float, ...]:
    """"50,90,99" -> (50.0, 90.0, 99.0); each in [0, 100]."""
    values = []
    for part in text.split(","):
        value = float(part)
        if not 0.0 <= value <= 100.0:
            raise ValueError(f"percentile {value} is outside [0, 100]")
        values.append(value)
    return tuple(values)


def percentile_key(pct: float) -> str:
    return f"p{pct:g}"


def distribution_ms(values_s: Sequence[float], percentiles: Sequence[float]) -> dict | None:
    """mean / median / std / requested percentiles of seconds, in milliseconds; None if empty."""
    if not values_s:
        return None
    values_ms = [v * 1000.0 for v in values_s]
    summary = {"count": len(values_ms), "mean": statistics.fmean(values_ms), "median": percentile(values_ms, 0.5),
               "std": statistics.pstdev(values_ms)}
    for pct in sorted(set(DEFAULT_PERCENTILES) | set(percentiles)):
        summary[percentile_key(pct)] = percentile(values_ms, pct / 100.0)
    return summary


def summarize(records: Sequence[RequestRecord], *, duration_s: float, percentiles: Sequence[float],
              slo: SloLimits, max_concurrency_reached: int) -> dict:
    """The benchmark's figures, JSON-ready (times in ms, rates per second)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    completed = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_input = sum(r.num_prompt_tokens or 0 for r in completed)
    total_output = sum(r.num_output_tokens or 0 for r in completed)
    return {
        "num_requests": len(records),
        "completed": len(completed),
        "failed": len(failed),
        "errors": [f"request {r.index}: {r.error}" for r in failed[:NUM_ERRORS_KEPT]],
        "num_without_usage": sum(1 for r in completed if not r.usage_reported),
        "duration_s": duration_s,
        "max_concurrency_reached": max_concurrency_reached,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration_s,
        "request_goodput": sum(1 for r in completed if slo.met_by(r)) / duration_s if slo.is_set else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in completed], percentiles),
        "tpot_ms": distribution_ms([r.tpot_s for r in completed if r.tpot_s is not None], percentiles),
        "itl_ms": distribution_ms([gap for r in completed for gap in r.itls_s], percentiles),
        "e2el_ms": distribution_ms([r.e2el_s for r in completed], percentiles),
    }


def request_summary(record: RequestRecord) -> dict:
    """One request, compact, for the result file (ITL as count / mean / max, not every gap)."""
    itls = record.itls_s

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000.0, 3)

    return {
        "index": record.index,
        "ok": record.success,
        "prompt_tokens": record.num_prompt_tokens,
        "output_tokens": record.num_output_tokens,
        "ttft_ms": ms(record.ttft_s),
        "tpot_ms": ms(record.tpot_s),
        "e2el_ms": ms(record.e2el_s),
        "num_itls": len(itls),
        "mean_itl_ms": ms(statistics.fmean(itls)) if itls else None,
        "max_itl_ms": ms(max(itls)) if itls else None,
        "finish_reason": record.finish_reason,
        "error": record.error,
    }
