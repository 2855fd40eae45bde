"""`moemesh bench serve`: load a running OpenAI-compatible server and report serving figures,
in the manner of `vllm bench serve`.

Requests arrive on a Poisson or fixed-rate schedule (or all at once), optionally capped at
`--max-concurrency` in flight; each streams with usage so token counts are the server's.
Reported: completed / failed, request and token throughput, goodput under TTFT / TPOT / E2EL
limits, and mean / median / percentiles of TTFT, TPOT, ITL and E2EL (see serve_metrics for
the definitions). Against a moemesh server it also reports what the decode steps of the run cost the
attention worker's host (`server_decode_steps`: the mean decode step time at the router, ZeroMQ messages
for layers and, when the server runs with `MOEMESH_COUNT_HOST_SYNCS=1`, synchronising CUDA calls, per
step and per layer, from `/status.json` before and after the run). The result JSON goes to bench/results/serve-<device>-<time>.json.

    moemesh bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4 \\
        --random-input-len 1024 --random-output-len 128 --ignore-eos --goodput ttft:2000 tpot:50

Torch-free: this runs on any client machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import structlog

from moemesh.bench.results_io import write_result
from moemesh.bench.serve_client import Endpoint, RequestOptions, RequestRecord, build_body, first_model, send_request
from moemesh.bench.serve_metrics import SloLimits, parse_goodput, parse_percentiles, request_summary, summarize
from moemesh.bench.serve_report import format_table
from moemesh.bench.serve_workload import (Arrival, PromptTrimmer, WorkloadRequest, arrival_offsets_s, file_requests,
                                  random_requests)

log = structlog.get_logger("bench")


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str
    endpoint: Endpoint
    model: str | None  # None: the first model of GET /v1/models
    num_prompts: int
    request_rate: float  # requests per second; math.inf sends all at once
    arrival: Arrival
    seed: int
    max_concurrency: int | None  # None: no cap
    temperature: float | None
    ignore_eos: bool
    slo: SloLimits
    percentiles: tuple[float, ...]
    timeout_s: float
    warmup_requests: int = 0  # sent (and waited for) before the timed requests, left out of every figure

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")

    def to_json(self) -> dict:
        body = asdict(self)
        body.update(endpoint=self.endpoint.value, arrival=self.arrival.value, slo=self.slo.to_json(),
                    request_rate=None if math.isinf(self.request_rate) else self.request_rate,
                    percentiles=list(self.percentiles))
        return body


@dataclass(frozen=True)
class BenchmarkRun:
    model: str
    records: list[RequestRecord]
    duration_s: float  # first send -> last completion
    max_concurrency_reached: int
    server_decode_steps: dict | None = None  # a moemesh server's decode step counters over the run


async def run_benchmark(config: ServeBenchConfig, workload: list[WorkloadRequest],
                        warmup: list[WorkloadRequest] = ()) -> BenchmarkRun:
    """Send `warmup` (at most max_concurrency at a time, all waited for, not recorded: the server's first
    requests of a shape pay its compiles and graph captures), then `workload` on the configured schedule,
    and return every request's record.

    Each request waits for its arrival time, then for a concurrency slot, then is sent: as in
    vllm, time spent waiting for a slot is not part of its TTFT or E2EL, and the peak number in
    flight is reported. Connections are unlimited beyond the cap, so the client never queues.
    """
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 30.0))
    async with httpx.AsyncClient(base_url=config.base_url, timeout=timeout, limits=limits,
                                 trust_env=False) as client:
        model = config.model or await first_model(client)
        options = RequestOptions(model, config.temperature, config.ignore_eos)
        bodies = [build_body(config.endpoint, request, options) for request in workload]
        offsets_s = arrival_offsets_s(len(workload), config.request_rate, config.arrival, config.seed)
        slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        in_flight = max_in_flight = 0

        async def one(index: int, start_s: float) -> RequestRecord:
            nonlocal in_flight, max_in_flight
            await asyncio.sleep(max(0.0, start_s + offsets_s[index] - time.perf_counter()))
            async with slots or contextlib.nullcontext():
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)
                try:
                    return await send_request(client, index, config.endpoint, bodies[index])
                finally:
                    in_flight -= 1

        if warmup:
            warm_slots = asyncio.Semaphore(config.max_concurrency or len(warmup))

            async def warm(index: int, body: dict) -> RequestRecord:
                async with warm_slots:
                    return await send_request(client, index, config.endpoint, body)

            warmed = await asyncio.gather(*(warm(i, build_body(config.endpoint, request, options))
                                            for i, request in enumerate(warmup)))
            failed = [record.error for record in warmed if record.error]
            log.info("bench.serve_warmed_up", num_requests=len(warmup), num_failed=len(failed),
                     errors=failed[:3])
        log.info("bench.serve_started", model=model, num_prompts=len(workload), url=config.base_url)
        counters_before = await _decode_step_counters(client)
        start_s = time.perf_counter()
        records = await asyncio.gather(*(one(index, start_s) for index in range(len(workload))))
        duration_s = time.perf_counter() - start_s
        counters_after = await _decode_step_counters(client)
    return BenchmarkRun(model, list(records), duration_s, max_in_flight,
                        decode_step_costs(counters_before, counters_after))


async def _decode_step_counters(client: httpx.AsyncClient) -> dict | None:
    """A moemesh server's `/status.json` decode step counters; None from other servers."""
    try:
        response = await client.get("/status.json")
        return response.json()["engine"]["decode_step_counters"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def decode_step_costs(before: dict | None, after: dict | None) -> dict | None:
    """The counters' difference over a run -> decode steps, ZeroMQ layer messages and host syncs per step and
    per layer (host syncs None when the server did not count them)."""
    if before is None or after is None:
        return None
    num_steps = after["num_steps"] - before["num_steps"]
    seconds = after["seconds"] - before["seconds"]
    num_layers = after["num_layers"]
    messages = after["data_messages"] - before["data_messages"]
    sync_steps = after["host_sync_steps"] - before["host_sync_steps"]
    syncs = after["host_syncs"] - before["host_syncs"]
    per_step = messages / num_steps if num_steps else None
    syncs_per_step = syncs / sync_steps if sync_steps else None
    return {"num_decode_steps": num_steps, "num_layers": num_layers,
            "decode_step_ms": seconds / num_steps * 1e3 if num_steps else None,
            "data_messages_per_step": per_step,
            "data_messages_per_layer": per_step / num_layers if per_step is not None and num_layers else None,
            "host_syncs_counted_steps": sync_steps, "host_syncs_per_step": syncs_per_step,
            "host_syncs_per_layer": (syncs_per_step / num_layers if syncs_per_step is not None and num_layers
                                     else None)}


def _run_async(coroutine):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("request rate must be > 0 (or inf)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moemesh bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", choices=[e.value for e in Endpoint], default="chat")
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s; inf: all at once")
    parser.add_argument("--arrival", choices=[a.value for a in Arrival], default="poisson")
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--dataset", choices=["random", "file"], default="random")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128,
                        help="max_tokens of random prompts, and of file lines without max_tokens")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--dataset-path", default=None, help="JSONL: prompt or messages, optional max_tokens")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json: cut random prompts to exactly --random-input-len tokens")
    parser.add_argument("--temperature", type=float, default=None, help="default: the server's")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: generate all max_tokens")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--percentiles", default="50,90,99", help="comma-separated, e.g. 50,90,99,99.9")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per-request read timeout")
    parser.add_argument("--warmup-requests", type=int, default=0,
                        help="requests of the same shape (other prompts) sent first and left out of the figures")
    parser.add_argument("--device-label", default=None, help="what the server runs on, for the result file")
    parser.add_argument("--result-dir", type=Path, default=None, help="default: bench/results/")
    parser.add_argument("--no-write", action="store_true", help="print only; write no JSON")
    return parser


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(
        base_url=args.base_url.rstrip("/"), endpoint=Endpoint(args.endpoint), model=args.model,
        num_prompts=args.num_prompts, request_rate=args.request_rate, arrival=Arrival(args.arrival),
        seed=args.seed, max_concurrency=args.max_concurrency, temperature=args.temperature,
        ignore_eos=args.ignore_eos, slo=parse_goodput(args.goodput),
        percentiles=parse_percentiles(args.percentiles), timeout_s=args.timeout_s,
        warmup_requests=args.warmup_requests)


def build_workload(args: argparse.Namespace, num_prompts: int | None = None, seed: int | None = None
                   ) -> list[WorkloadRequest]:
    """The timed requests, or with num_prompts / seed given the warm-up ones (a file's first lines; random
    prompts of the same lengths from another seed)."""
    num_prompts = args.num_prompts if num_prompts is None else num_prompts
    if args.dataset == "file":
        if not args.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        return file_requests(args.dataset_path, num_prompts, default_max_tokens=args.random_output_len)
    trimmer = PromptTrimmer(args.tokenizer) if args.tokenizer else None
    return random_requests(num_prompts, input_len=args.random_input_len, output_len=args.random_output_len,
                           range_ratio=args.random_range_ratio, seed=args.seed if seed is None else seed,
                           trimmer=trimmer)


def _ratios(metrics: dict) -> dict:
    throughput = metrics["request_throughput"]
    total_tokens = metrics["total_input_tokens"] + metrics["total_output_tokens"]
    return {
        "completed_fraction": metrics["completed"] / metrics["num_requests"],
        "goodput_over_throughput": (metrics["request_goodput"] / throughput
                                    if metrics["request_goodput"] is not None and throughput else None),
        "output_over_total_tokens": metrics["total_output_tokens"] / total_tokens if total_tokens else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Returns 0 when at least one request completed, 1 when none did or the server could
    not be reached, 2 for bad arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        workload = build_workload(args)
        warmup = build_workload(args, config.warmup_requests, args.seed + 1) if config.warmup_requests else []
    except (ValueError, OSError) as error:
        parser.error(str(error))
    try:
        run = _run_async(run_benchmark(config, workload, warmup))
    except (httpx.HTTPError, RuntimeError, ValueError) as error:
        print(f"bench serve: cannot benchmark {config.base_url}: {type(error).__name__}: {error}")
        return 1
    metrics = summarize(run.records, duration_s=run.duration_s, percentiles=config.percentiles, slo=config.slo,
                        max_concurrency_reached=run.max_concurrency_reached)
    print(f"model {run.model} at {config.base_url} ({config.endpoint.value}), {config.num_prompts} prompts, "
          f"rate {config.request_rate} req/s ({config.arrival.value}), max concurrency {config.max_concurrency}")
    print(format_table(metrics, config.percentiles))
    if run.server_decode_steps is not None:
        costs = run.server_decode_steps
        print(f"server decode steps: {costs['num_decode_steps']}, {costs['num_layers']} layers, "
              f"{costs['decode_step_ms']} ms each; ZeroMQ layer messages per step {costs['data_messages_per_step']}, "
              f"host syncs per step {costs['host_syncs_per_step']} (counted in {costs['host_syncs_counted_steps']} steps)")
    if not args.no_write:
        raw = {"config": dict(config.to_json(), model=run.model, dataset=args.dataset,
                              dataset_path=args.dataset_path, random_input_len=args.random_input_len,
                              random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio),
               "metrics": metrics, "server_decode_steps": run.server_decode_steps,
               "requests": [request_summary(record) for record in run.records]}
        device = args.device_label or f"server at {config.base_url} (client {platform.node()})"
        command = shlex.join(["moemesh", "bench", "serve", *(argv if argv is not None else sys.argv[1:])])
        path = write_result("serve", raw, _ratios(metrics), device=device, command=command, out_dir=args.result_dir)
        print(f"wrote {path}")
    log.info("bench.serve_finished", completed=metrics["completed"], failed=metrics["failed"])
    return 0 if metrics["completed"] else 1
