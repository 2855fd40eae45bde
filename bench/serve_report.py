"""The printed table of `moemesh bench serve` (the layout of `vllm bench serve`'s summary)."""

from __future__ import annotations

from collections.abc import Sequence

from moemesh.bench.serve_metrics import percentile_key

WIDTH = 50
SECTIONS = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value!s:<10}"


def _title(text: str, fill: str) -> str:
    return f"{' ' + text + ' ' if fill == '=' else text:{fill}^{WIDTH}}"


def format_table(metrics: dict, percentiles: Sequence[float]) -> str:
    lines = [_title("Serving Benchmark Result", "="),
             _row("Successful requests:", metrics["completed"]),
             _row("Failed requests:", metrics["failed"]),
             _row("Peak concurrent requests:", metrics["max_concurrency_reached"]),
             _row("Benchmark duration (s):", metrics["duration_s"]),
             _row("Total input tokens:", metrics["total_input_tokens"]),
             _row("Total generated tokens:", metrics["total_output_tokens"]),
             _row("Request throughput (req/s):", metrics["request_throughput"])]
    if metrics["request_goodput"] is not None:
        lines.append(_row("Request goodput (req/s):", metrics["request_goodput"]))
    lines += [_row("Output token throughput (tok/s):", metrics["output_throughput"]),
              _row("Total token throughput (tok/s):", metrics["total_token_throughput"])]
    if metrics["num_without_usage"]:
        lines.append(_row("Requests without usage (counted events):", metrics["num_without_usage"]))
    for key, short, title in SECTIONS:
        lines.append(_title(title, "-"))
        summary = metrics[key]
        if summary is None:
            lines.append(_row(f"{short} (ms):", "n/a"))
            continue
        lines.append(_row(f"Mean {short} (ms):", summary["mean"]))
        lines.append(_row(f"Median {short} (ms):", summary["median"]))
        shown = sorted(({90.0, 99.0} | set(percentiles)) - {50.0})  # p50 is the median
        for pct in shown:
            lines.append(_row(f"P{pct:g} {short} (ms):", summary[percentile_key(pct)]))
    lines.append("=" * WIDTH)
    for error in metrics["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
