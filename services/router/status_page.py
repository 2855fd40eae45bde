"""The gateway's status page: `GET /` (HTML that refreshes itself) and `GET /status.json`.

`/status.json` is one snapshot, built from what the router already has, torch-free:
- `health`: `engine.health()` (ok + one status per service, the same truth as `/health`);
- `router`: the gateway process itself (pid, seconds since its routes were built);
- `engine`: `engine.stats()` (running and queued requests, KV blocks used / total per tier);
- `throughput`: generated tokens per second over the last `window_s`, from the gateway's
  Prometheus counter, sampled on every snapshot; speculative acceptance from its counters;
- `services`: per worker as the supervisor saw it (role, pid, device, state, seconds since
  its last message), when the router wires a supervisor in (`StatusSources`);
- `load_progress`: each service's model-loading progress file (`common.runtime.load_progress`),
  with the bytes it is expected to read and the fraction done (`status_page_progress`) when
  the model directory is known;
- `weights`: each worker's weight bytes on its device and in the checkpoint (`report_weights`);
- `requests`: HTTP generation requests by outcome (ok, engine_error, ...), from the counter;
- `restarts`: what `moemesh serve` restarted (common.runtime.restart_record), by service;
- `placement`: experts per (worker, layer) from the deployment's placement, and
  `layer_heat`: activations per (layer, expert), all phases, live from the attention worker's
  latest RoutingSummary (sent every few steps in a StepResult), else a file's counts
  (`StatusSources.layer_heat`), else None.

The HTML page is static and fetches `/status.json` every two seconds; it has no third-party
assets, so it renders offline (and in a headless browser in the tests).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from moemesh.common.runtime.load_progress import read_progress
from moemesh.common.runtime.restart_record import read_restarts, restarts_path_for
from moemesh.services.router.status_page_progress import load_sizes, with_expected

log = structlog.get_logger("router")


@dataclass(frozen=True)
class StatusSources:
    """What the router adds beyond the engine: set as `app.state.status_sources`.
    placement: {worker name: {layer: [expert ids]}}; layer_heat: [[count per expert] per layer]
    (a fallback: live counts from the attention worker take precedence); restarts_path: serve's
    restart record (None: `<run_dir>/serve_restarts.json`, the run dir being the progress dir's parent);
    model_path: the checkpoint directory, whose config sizes each service's load (None: no fractions)."""

    supervisor: Any = None  # common.runtime.supervisor.Supervisor
    progress_dir: str | None = None
    model_path: str | None = None
    placement: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    layer_heat: list[list[int]] | None = None
    restarts_path: str | None = None

    def restarts_file(self) -> Path | None:
        if self.restarts_path is not None:
            return Path(self.restarts_path)
        return restarts_path_for(Path(self.progress_dir).parent) if self.progress_dir else None


class _Rates:
    """Tokens/s from a monotonically increasing counter, over a sliding window."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, value: float) -> float | None:
        now_s = time.monotonic()
        self.samples.append((now_s, value))
        while len(self.samples) > 2 and now_s - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        first_s, first_value = self.samples[0]
        return None if now_s - first_s < 1e-3 else (value - first_value) / (now_s - first_s)


def _counter(metrics: Any, name: str) -> float:
    value = metrics.registry.get_sample_value(name) if metrics is not None else None
    return float(value or 0.0)


def _requests_by_outcome(metrics: Any) -> dict[str, int]:
    totals: dict[str, int] = {}
    if metrics is None:
        return totals
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                outcome = sample.labels.get("outcome", "unknown")
                totals[outcome] = totals.get(outcome, 0) + int(sample.value)
    return totals


def _layer_heat(engine_stats: dict, sources: StatusSources) -> list[list[int]] | None:
    summary = engine_stats.get("routing_summary")
    counts = getattr(summary, "layer_counts", ()) if summary is not None else ()
    if counts:
        return [list(row) for row in counts]
    return sources.layer_heat


def status_snapshot(engine: Any, metrics: Any, sources: StatusSources, rates: _Rates,
                    started_monotonic_s: float | None = None) -> dict:
    report = engine.health()
    engine_stats = engine.stats()
    generated = _counter(metrics, "moemesh_generation_tokens_total")
    drafted = _counter(metrics, "moemesh_spec_draft_tokens_total")
    accepted = _counter(metrics, "moemesh_spec_accepted_tokens_total")
    snapshot = {
        "time_unix_s": time.time(),
        "health": {"ok": report.ok, "services": dict(report.services)},
        # the gateway itself (this process): health["services"] names it only while it stops
        "router": {"pid": os.getpid(), "uptime_s": None if started_monotonic_s is None
                   else round(time.monotonic() - started_monotonic_s, 1)},
        "engine": {key: value for key, value in engine_stats.items() if key != "routing_summary"},
        "requests": _requests_by_outcome(metrics),
        "restarts": read_restarts(sources.restarts_file()),
        "throughput": {"generated_tokens": generated, "tokens_per_s": rates.add(generated),
                       "window_s": rates.window_s,
                       "spec_acceptance": accepted / drafted if drafted else None},
        "services": _services(sources.supervisor),
        "load_progress": _load_progress(sources),
        "weights": _weights(sources),
        "placement": {name: {str(layer): experts for layer, experts in layers.items()}
                      for name, layers in sources.placement.items()},
        "layer_heat": _layer_heat(engine_stats, sources),
    }
    return snapshot


def _weights(sources: StatusSources) -> list[dict]:
    """Per worker: weight bytes resident on its device, stored in the checkpoint, and their ratio."""
    from moemesh.common.runtime.load_progress import weight_records

    return [{**record, "resident_over_stored": round(record["resident_bytes"] / record["stored_bytes"], 4)
             if record["stored_bytes"] else None} for record in weight_records(sources.progress_dir)]


def _load_progress(sources: StatusSources) -> list[dict]:
    records = read_progress(sources.progress_dir) if sources.progress_dir else []
    sizes = None
    if sources.model_path is not None:
        try:
            sizes = load_sizes(str(sources.model_path))
        except (OSError, ValueError) as error:  # display only: progress without fractions
            log.warning("router.status_load_sizes_unavailable", error=str(error)[:200])
    return with_expected(records, sizes, sources.placement)


def _services(supervisor: Any) -> list[dict]:
    if supervisor is None:
        return []
    now_s = time.monotonic()
    rows = []
    for name in sorted(set(supervisor.ready) | set(supervisor.heartbeats)):
        ready = supervisor.ready.get(name)
        beat = supervisor.heartbeats.get(name)
        seen_s = supervisor.last_seen_s.get(name)
        rows.append({
            "name": name,
            "role": str(ready.role) if ready is not None else (str(beat.role) if beat is not None else None),
            "pid": ready.pid if ready is not None else None,
            "device": ready.device if ready is not None else None,
            "state": str(beat.state) if beat is not None else ("ready" if ready is not None else "unknown"),
            "num_inflight": beat.num_inflight if beat is not None else 0,
            "silence_s": None if seen_s is None else round(now_s - seen_s, 2),
        })
    return rows


def status_routes(engine: Any, metrics: Any) -> list[Route]:
    """`/` and `/status.json`; the sources come from `request.app.state.status_sources`."""
    rates = _Rates()
    started_monotonic_s = time.monotonic()

    async def status_json(request: Request) -> Response:
        sources = getattr(request.app.state, "status_sources", None) or StatusSources()
        return JSONResponse(status_snapshot(engine, metrics, sources, rates, started_monotonic_s))

    async def status_html(_: Request) -> Response:
        return HTMLResponse(_page_html())

    return [Route("/", status_html, methods=["GET"]), Route("/status.json", status_json, methods=["GET"])]


def _page_html() -> str:
    return (Path(__file__).with_name("status_page.html")).read_text(encoding="utf-8")
