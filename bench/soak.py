"""Soak benchmark: a long run of concurrent streams with random client aborts and periodic
restarts of one expert worker, on the default model.

    python -m moemesh.bench.soak [--minutes 20] [--concurrency 8] [--restart-interval-s 120] [--abort-probability 0.2]

The services run under `moemesh serve` itself (the default model, `--expert-workers` 2, the
drafter when the checkpoint has one), which restarts a service that dies: every interval the
soak SIGKILLs one expert worker (found by its `--name` among serve's children in /proc) and
waits for serve to bring up a new process, while the streams keep going. So the benchmark also
checks serve's restart path and the attention worker's step recovery on the restarted worker.

Reported (JSON through `bench.results_io.write_result`, name "soak"): requests completed, failed
(HTTP error, finish_reason "error", transport error) and aborted by the client; restarts done,
how long each took to show a new pid, and what serve itself counted (`/status.json` restarts;
must equal the kills); how often a kill hit a step in flight (the attention worker's
step-recovery log events: lost, recovered, abandoned); KV blocks still in use per tier once the load stopped and the system
went idle (from `/metrics` `moemesh_kv_blocks_used`; anything above 0 is a leak); RSS per
service (serve included) at the end of the warm-up and at the end, and its growth (for a
restarted worker, its current process from its warm-up on); serve's exit code after SIGTERM.
Exit code 0 only when requests completed, no block leaked, the system was healthy at the end,
serve counted every restart and stopped cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "kjv-dsv4-mini"
PROMPTS = (
    "In the beginning God",
    "The LORD is my shepherd;",
    "Blessed are the poor in spirit:",
    "For God so loved the world,",
    "Charity suffereth long, and is kind;",
    "And God said, Let there be light:",
    "Rejoice in the Lord alway:",
    "In the beginning was the Word,",
)
_KV_USED = re.compile(r'^moemesh_kv_blocks_used\{tier="(\w+)"\}\s+([0-9.eE+-]+)$', re.MULTILINE)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moemesh.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="load duration (default 20)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent client streams (default 8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="upper bound of max_tokens per request")
    parser.add_argument("--abort-probability", type=float, default=0.2,
                        help="share of requests the client drops mid-stream (default 0.2)")
    parser.add_argument("--restart-interval-s", type=float, default=120.0,
                        help="SIGKILL and restart one expert worker this often (default 120; 0: never)")
    parser.add_argument("--expert-workers", type=int, default=2, help="expert worker processes (default 2)")
    parser.add_argument("--port", type=int, default=8417, help="HTTP port (default 8417)")
    parser.add_argument("--warmup-s", type=float, default=30.0,
                        help="seconds of load before the RSS baseline (also after each restart)")
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="client bound per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="results directory (default bench/results)")
    return parser


@dataclass
class Counts:
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    num_stream_chunks: int = 0  # SSE chunks with a choice (one or more tokens each, with speculation)
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failed += 1
        self.failures[why] = self.failures.get(why, 0) + 1


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def kv_blocks_used(metrics_text: str) -> dict[str, int]:
    return {tier: int(float(value)) for tier, value in _KV_USED.findall(metrics_text)}


async def _one_request(client, base_url: str, rng: random.Random, args, counts: Counts) -> None:
    max_tokens = rng.randint(8, args.max_tokens)
    abort_after = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < args.abort_probability else None
    body = {"model": args.served_model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "stream": True,
            "temperature": rng.choice((0.0, 0.7, 1.0)), "seed": rng.randint(0, 2**31 - 1)}
    num_chunks, finish_reason = 0, None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body,
                                 timeout=args.request_timeout_s) as reply:
            if reply.status_code != 200:
                await reply.aread()
                counts.fail(f"http_{reply.status_code}")
                await asyncio.sleep(0.5)  # no hot loop of refused requests (e.g. 503 while a worker restarts)
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: "):])["choices"][0]
                num_chunks += 1
                finish_reason = choice.get("finish_reason") or finish_reason
                if abort_after is not None and num_chunks >= abort_after and finish_reason is None:
                    counts.aborted += 1  # leaving the block closes the connection: the server aborts
                    return
    except Exception as error:  # noqa: BLE001 - any transport failure is a failed request here
        counts.fail(type(error).__name__)
        await asyncio.sleep(0.5)
        return
    if finish_reason in ("length", "stop"):
        counts.completed += 1
        counts.num_stream_chunks += num_chunks
    else:
        counts.fail(f"finish_{finish_reason}")


async def _client_loop(base_url: str, seed: int, deadline: float, args, counts: Counts) -> None:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            await _one_request(client, base_url, rng, args, counts)


def child_pids(parent_pid: int) -> dict[str, int]:
    """{service name: pid} of the services `moemesh serve` (parent_pid) runs now, from /proc
    (each child's command line carries `--name NAME`)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid != parent_pid:
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            continue
        if "--name" in argv[:-1]:
            found[argv[argv.index("--name") + 1]] = int(entry.name)
    return found


class Soak:
    """Runs `moemesh serve` (which restarts a dead service), the load, a SIGKILL of one expert
    worker on schedule, and samples RSS per service."""

    def __init__(self, args) -> None:
        from moemesh.common.checkpoint.model_dir import check_model_dir

        self.args = args
        self.model_dir = check_model_dir(args.model)
        self.run_dir = Path(tempfile.mkdtemp(prefix="moemesh-soak-"))
        self.log_dir = self.run_dir / "logs"
        self.base_url = f"http://127.0.0.1:{args.port}"
        self.process: subprocess.Popen | None = None
        self.restarted_at: dict[str, float] = {}  # name -> when its current process started (monotonic)
        self.rss_samples: dict[str, list[tuple[float, int, int]]] = {}  # name -> (at, pid, rss)
        self.num_restarts = 0  # SIGKILLs sent whose replacement came up
        self.restart_waits_s: list[float] = []
        self.speculation = "default"
        self.started_at = time.monotonic()

    def start(self) -> None:
        command = [sys.executable, "-m", "moemesh.cli", "serve", "--model", str(self.model_dir),
                   "--port", str(self.args.port), "--expert-workers", str(self.args.expert_workers),
                   "--run-dir", str(self.run_dir), "--ready-timeout", "600",
                   # restarts are this benchmark's point: a budget it never spends
                   "--max-restarts", "1000"]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        with open(self.run_dir / "serve.stderr", "wb") as stderr:
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                            env=env, start_new_session=True)

    def pids(self) -> dict[str, int]:
        return child_pids(self.process.pid) if self.process is not None else {}

    def health(self) -> int | None:
        import httpx

        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code
        except httpx.HTTPError:
            return None

    def wait_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.health() == 200:
                return True
            if self.process is not None and self.process.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    async def restart_expert(self, name: str) -> None:
        """SIGKILL the expert worker; `moemesh serve` must start it again (a new pid) on its own."""
        old_pid = self.pids().get(name)
        if old_pid is None:
            print(f"soak: {name} is not running (restart still pending?); skipped", file=sys.stderr, flush=True)
            return
        os.kill(old_pid, signal.SIGKILL)
        killed_s = time.monotonic()
        print(f"soak: SIGKILLed {name} (pid {old_pid}); serve restarts it", file=sys.stderr, flush=True)
        while time.monotonic() - killed_s < 120:
            await asyncio.sleep(0.25)
            new_pid = self.pids().get(name)
            if new_pid not in (None, old_pid):
                self.restarted_at[name] = time.monotonic()
                self.restart_waits_s.append(round(time.monotonic() - killed_s, 2))
                self.num_restarts += 1
                return
        print(f"soak: {name} was not restarted within 120 s", file=sys.stderr, flush=True)

    def sample_rss(self) -> None:
        now = time.monotonic()
        serve_rss = rss_bytes(self.process.pid) if self.process is not None else None
        pids = {**self.pids(), **({"serve": self.process.pid} if serve_rss is not None else {})}
        for name, pid in pids.items():
            value = rss_bytes(pid)
            if value is not None:
                self.rss_samples.setdefault(name, []).append((now, pid, value))

    def rss_report(self) -> dict[str, dict]:
        report = {}
        for name, samples in self.rss_samples.items():
            # a restarted service is measured from its last restart's warm-up (its pid since then)
            since = max(self.restarted_at.get(name, self.started_at), self.started_at) + self.args.warmup_s
            last_pid = samples[-1][1]
            window = [value for at, pid, value in samples if at >= since and pid == last_pid]
            if len(window) < 2:
                report[name] = {"samples": len(window), "note": "too few samples after warm-up"}
                continue
            report[name] = {"rss_start_mib": round(window[0] / 2**20, 1), "rss_end_mib": round(window[-1] / 2**20, 1),
                            "rss_growth_mib": round((window[-1] - window[0]) / 2**20, 1),
                            "rss_max_mib": round(max(window) / 2**20, 1), "samples": len(window),
                            "restarted": name in self.restarted_at}
        return report

    def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)  # serve drains and stops every service in order
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()

    async def run_load(self) -> Counts:
        counts = Counts()
        self.started_at = time.monotonic()
        deadline = self.started_at + self.args.minutes * 60
        clients = [asyncio.create_task(_client_loop(self.base_url, self.args.seed * 1000 + index, deadline,
                                                    self.args, counts))
                   for index in range(self.args.concurrency)]
        rng = random.Random(self.args.seed)
        experts = [f"expert-{index}" for index in range(self.args.expert_workers)]
        next_restart = (self.started_at + self.args.restart_interval_s) if self.args.restart_interval_s > 0 else None
        last_report = last_sample = self.started_at
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            if time.monotonic() - last_sample >= 5:
                last_sample = time.monotonic()
                self.sample_rss()
            if next_restart is not None and time.monotonic() >= next_restart \
                    and deadline - time.monotonic() > self.args.warmup_s:  # leave time to measure it afterwards
                await self.restart_expert(rng.choice(experts))
                next_restart += self.args.restart_interval_s
            if time.monotonic() - last_report >= 30:
                last_report = time.monotonic()
                print(f"soak: {last_report - self.started_at:.0f} s completed={counts.completed} "
                      f"failed={counts.failed} aborted={counts.aborted}", file=sys.stderr, flush=True)
        await asyncio.gather(*clients)  # each finishes its current request (bounded by the request timeout)
        self.sample_rss()
        return counts


def _metrics_text(base_url: str) -> str:
    import httpx

    return httpx.get(f"{base_url}/metrics", timeout=10).text


def _recovery_events(log_dir: Path) -> dict[str, int]:
    """How often a kill hit a step in flight: the attention workers' step-recovery log events
    (services/attention/recovery.py), counted from their JSON log lines."""
    counts: dict[str, int] = {}
    wanted = ("attention.step_lost_expert", "attention.step_recovered", "attention.step_abandoned")
    for path in sorted(log_dir.glob("attention-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line).get("event")
            except ValueError:
                continue
            if event in wanted:
                counts[event] = counts.get(event, 0) + 1
    return counts


def _json(base_url: str, path: str) -> dict:
    import httpx

    try:
        return httpx.get(f"{base_url}{path}", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _served_model(base_url: str) -> str:
    import httpx

    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    """0 when the soak ran, served requests and leaked no blocks; 1 otherwise."""
    from moemesh.bench.results_io import write_result

    args = build_parser().parse_args(argv)
    soak = Soak(args)
    soak.start()
    try:
        if not soak.wait_healthy(600):
            print(f"soak: services never became healthy; logs in {soak.log_dir}", file=sys.stderr)
            return 1
        args.served_model = _served_model(soak.base_url)
        started = time.monotonic()
        counts = asyncio.run(soak.run_load())
        elapsed_s = time.monotonic() - started
        healthy_at_end = soak.wait_healthy(60)
        time.sleep(2.0)  # let the last aborts reach the engine loop
        leaked = kv_blocks_used(_metrics_text(soak.base_url))
        rss = soak.rss_report()
        health = _json(soak.base_url, "/health")
        serve_restarts = _json(soak.base_url, "/status.json").get("restarts", {})
    finally:
        serve_exit_code = soak.stop()
    raw = {
        "minutes": args.minutes, "elapsed_s": round(elapsed_s, 1), "concurrency": args.concurrency,
        "expert_workers": args.expert_workers, "restart_interval_s": args.restart_interval_s,
        "abort_probability": args.abort_probability, "drafter": "draft" in health.get("services", {}),
        "requests_completed": counts.completed, "requests_failed": counts.failed,
        "requests_aborted_by_client": counts.aborted, "failures_by_kind": counts.failures,
        "stream_chunks_completed": counts.num_stream_chunks, "expert_restarts": soak.num_restarts,
        "restart_wait_s": soak.restart_waits_s, "serve_restarts": serve_restarts,
        "serve_exit_code": serve_exit_code, "attention_recovery_events": _recovery_events(soak.log_dir),
        "kv_blocks_used_at_end": leaked, "blocks_leaked": sum(leaked.values()),
        "healthy_at_end": healthy_at_end, "rss_by_service": rss, "log_dir": str(soak.log_dir),
    }
    total = counts.completed + counts.failed
    ratios = {"failed_share": round(counts.failed / total, 4) if total else None,
              "completed_requests_per_s": round(counts.completed / elapsed_s, 3),
              "stream_chunks_per_s": round(counts.num_stream_chunks / elapsed_s, 2)}
    path = write_result("soak", raw, ratios, out_dir=Path(args.out_dir) if args.out_dir else None)
    print(json.dumps({**raw, **ratios}, indent=2))
    print(f"soak: wrote {path}", file=sys.stderr)
    restarts_seen = sum(record.get("num_restarts", 0) for record in serve_restarts.values())
    ok = (counts.completed > 0 and raw["blocks_leaked"] == 0 and healthy_at_end and bool(leaked)
          and restarts_seen == soak.num_restarts and serve_exit_code == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
