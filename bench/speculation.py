"""`moemesh bench speculation`: tokens/s with speculation off, fixed and adaptive, in one run.

Starts one `moemesh serve` per mode on the same model and devices (all at once, so their start-up
overlaps; they are then measured one after the other, the others idle), and for temperature 0
and 1, one stream and N streams, sends the same streamed completions (running text of chapters the default
model memorised, so decodes run long) and measures output tokens per second (wall clock over the batch), the
decode alone (the tokens after each request's first, over first token .. last token: TTFT left out), TTFT
(one run over HTTP: speculation_client.measure_run), the mean accepted length per verify step (bonus included)
from each response's usage.speculative, and the speedup over the `off` server of the same run.

Where the time goes, per run, from the router's counters (/status.json, before and after):
engine steps, mean attention step time (plan sent .. StepResult: the forward, verification and
the features sent to the drafter), mean drafter round trip (DraftRequest .. DraftTokens; with the
drafter in the attention worker, the drafting inside the step, which the step time then excludes), and the
rest of the wall clock per step (router, HTTP, scheduling). After the servers stop, the drafter's
own compute per proposal and per features message and the attention worker's feature-send time
come from their logs (`draft.timing_summary` or `attention.drafter_summary`, `attention.feature_send_summary`,
`attention.step_phase_summary`: the attention worker's step time by phase, decode and verify steps apart).

Deterministic decode check (in the manner of Lucebox's bench_ds4_decode.py); the benchmark exits 1
when any holds:
- a run is short: a request produced no token, or ended before max_tokens other than on EOS (with
  --ignore-eos: any request with fewer than max_tokens tokens);
- a request hit a cached prefix (usage.prompt_tokens_details.cached_tokens > 0);
- a run had zero throughput;
- greedy outputs (sha256 over every request's text) differ between a speculative mode and off;
- speculation did not run in a speculative run (no request with usage.speculative.ran).
  In adaptive mode the router's cost-aware policy may legitimately verify nothing (a plain step pays
  better); such a run passes when the router's counters show the drafter was consulted or steps
  were skipped by the policy (the counters are in the run's `policy` entry).
Prompts carry a per-run nonce so no run reuses another's prefix. Writes
`speculation-<time>.json` (bench.results_io) under --out-dir (default bench/results/), also when a
configuration fails, a server does not start, --time-budget-s runs out, or SIGTERM / SIGINT stops the
run (the JSON then holds the runs finished so far, and `problems` says why it stopped).
Speed is printed, never asserted.

Modes: off, fixed, adaptive (the confidence rule and the router's cost-aware widths:
MOEMESH_SPEC_WIDTH_POLICY=cost for that server's router), and `confidence` (adaptive with the
confidence rule alone: the router keeps the drafter's widths), for comparing the two in one run;
`-process` after fixed or adaptive puts the drafter in a draft worker process, `-sampled` has sampled
requests draw their drafts from the drafter's distribution (`serve --draft-sampling sampled`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moemesh.bench.speculation_checks import run_problems, speedups
from moemesh.bench.speculation_client import measure_run

REPO_ROOT = Path(__file__).resolve().parents[1]
# Running text of the chapters the default model memorised (its training format `Book C:V text`), so
# decodes run long and drafts have something to get right, as on code or maths for a real model.
PROMPTS = [  # the first one alone is the single-stream run: Psalms 119 is long, so it decodes to max_tokens
    "Psalms 119:1 Blessed are the", "Psalms 23:1 The LORD is my shepherd;", "Genesis 1:1 In the beginning God",
    "Matthew 5:3 Blessed are the poor in spirit:", "John 1:1 In the beginning was the Word,",
    "John 3:16 For God so loved the world,", "1 Corinthians 13:4 Charity suffereth long,",
    "Matthew 6:9 After this manner therefore pray ye:",
]
# fixed-process / adaptive-process: the same with the drafter in a draft worker process of its own
# (`serve --draft-placement process`); the others keep serve's default, the drafter in the attention worker.
# fixed-sampled / adaptive-sampled: sampled requests draw their drafts from the drafter's distribution
# (`serve --draft-sampling sampled`) instead of serve's default, the drafter's argmax
MODES = ("off", "fixed", "adaptive", "confidence", "fixed-process", "adaptive-process", "fixed-sampled",
         "adaptive-sampled")
DEFAULT_MODES = ("off", "fixed", "adaptive")
SERVE_MODE = {"off": "off", "fixed": "fixed", "adaptive": "adaptive", "confidence": "adaptive",
              "fixed-process": "fixed", "adaptive-process": "adaptive", "fixed-sampled": "fixed",
              "adaptive-sampled": "adaptive"}
# the router's width policy per bench mode (services/router/engine_drafts.py: width_policy_from_env)
WIDTH_POLICY = {"off": "drafter", "fixed": "drafter", "adaptive": "cost", "confidence": "drafter",
                "fixed-process": "drafter", "adaptive-process": "cost", "fixed-sampled": "drafter",
                "adaptive-sampled": "cost"}


@dataclass
class Server:
    mode: str
    process: subprocess.Popen
    run_dir: Path
    base_url: str
    first_line: str = ""


def _die_with_parent() -> None:  # in the child between fork and exec: serve gets SIGTERM if the bench dies
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_args(mode: str, spec_width: int | None) -> list[str]:
    if mode == "off":
        return ["--speculation", "off"]
    placement = ["--draft-placement", "process"] if mode.endswith("-process") else []
    sampling = ["--draft-sampling", "sampled"] if mode.endswith("-sampled") else []
    return (["--speculation", SERVE_MODE[mode]] + (["--spec-width", str(spec_width)] if spec_width else [])
            + placement + sampling)


def _launch(model: str, mode: str, extra: list[str]) -> Server:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-spec-{mode}-"))
    port = _free_port()
    command = [sys.executable, "-m", "moemesh.cli", "serve", "--model", model, "--port", str(port), "--run-dir",
               str(run_dir), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               MOEMESH_SPEC_WIDTH_POLICY=WIDTH_POLICY[mode])
    with open(run_dir / "serve.stderr", "wb") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                   preexec_fn=_die_with_parent)
    return Server(mode, process, run_dir, f"http://127.0.0.1:{port}")


def _await_ready(server: Server) -> None:
    server.first_line = server.process.stdout.readline()
    if "moemesh serving" not in server.first_line:
        tail = (server.run_dir / "serve.stderr").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"serve ({server.mode}) did not start: {server.first_line!r}\n{tail}")


def _stop_all(servers: list[Server], timeout_s: float) -> None:
    """SIGTERM every server at once, wait up to timeout_s in all, then kill what is left."""
    for server in servers:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    deadline_s = time.monotonic() + timeout_s
    for server in servers:
        try:
            server.process.wait(timeout=max(0.1, deadline_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def _log_summaries(run_dir: Path) -> dict:
    """The last timing summary of the drafter, the attention worker's feature sender and its step phases
    (written at their drain) from the service logs of one server."""
    wanted = {"draft.timing_summary": "drafter", "attention.drafter_summary": "drafter",
              "attention.feature_send_summary": "feature_sender", "attention.step_phase_summary": "step_phases"}
    found: dict = {}
    for path in sorted((run_dir / "logs").glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if not any(event in line for event in wanted):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            key = wanted.get(record.get("event"))
            if key is not None:
                found[key] = {k: v for k, v in record.items() if k not in ("event", "timestamp", "level", "logger")}
    return found


def _print_run(key: str, run: dict) -> None:
    print(f"{key:44s} {run['tokens_per_s']:8.2f} tok/s  decode {run['decode_tokens_per_s']:8.2f} tok/s  "
          f"ttft {1e3 * run['time_to_first_token_s']:6.1f} ms  tokens {run['num_output_tokens']:5d}  "
          f"accepted length {run['mean_accepted_length']:.2f}  drafts {run['draft_tokens']:5d}  "
          f"steps {run['num_steps']:4.0f}  step {run['step_ms_mean']:6.1f} ms  "
          f"draft rtt {run['draft_round_trip_ms_mean']:5.1f} ms  other {run['other_ms_per_step']:5.1f} ms/step",
          flush=True)


def _print_phase_medians(mode: str, fields: dict) -> None:
    """One line per kind of step: the attention worker's median ms per phase (step_phases.py)."""
    for kind in ("decode", "verify", "prefill"):
        if f"{kind}_total_ms_median" not in fields:
            continue
        parts = " ".join(f"{name} {fields.get(f'{kind}_{name}_ms_median', 0.0):.2f}"
                         for name in ("prepare", "forward", "forward_device", "sample", "features", "draft", "rest"))
        print(f"{mode:10s} {kind:7s} steps {fields.get(f'{kind}_num_steps', 0):5d}  median ms: total "
              f"{fields[f'{kind}_total_ms_median']:.2f} = {parts}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moemesh bench speculation")
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "kjv-dsv4-mini"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8, help="the multi-stream runs' concurrency")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated subset of " + ",".join(MODES) + " (must include off)")
    parser.add_argument("--speculation", default=None, choices=("fixed", "adaptive"),
                        help="shorthand for --modes off,<mode> (the previous interface)")
    parser.add_argument("--spec-width", type=int, default=None, help="width of the speculative modes")
    parser.add_argument("--devices", default="cpu", help="passed to serve (e.g. cuda:0)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="ask for ignore_eos so every request decodes max_tokens (default: requests may end at EOS)")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--out-dir", default=None, help="result directory (default bench/results/)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration and mode (median kept)")
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--keep-logs", default=None, help="copy the servers' service logs here at the end")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="start no run after this many seconds from launch (the JSON lists what was skipped)")
    args = parser.parse_args(argv)
    if args.speculation:
        args.modes = f"off,{args.speculation}"
    args.mode_list = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if "off" not in args.mode_list or any(mode not in MODES for mode in args.mode_list):
        parser.error(f"--modes {args.modes!r}: a subset of {','.join(MODES)} that includes off")
    return args


def _measure(servers: list[Server], args: argparse.Namespace, ignore_eos: bool, problems: list[str],
             runs: dict[str, list[dict]], deadline_s: float | None = None) -> None:
    """Every (temperature, streams) configuration on every server, interleaved (off, fixed,
    adaptive, then again in rotated order) so slow drifts of the host hit every mode alike. Appends
    each finished run to runs[key] as it goes (so a stop keeps them); `_summarise` picks the median.
    deadline_s (time.monotonic): no run starts after it."""
    temperatures = [float(t) for t in args.temperatures.split(",")]
    stream_counts = sorted({1, args.streams})
    for server in servers:  # first-step costs out of the figures (Triton compiles, CUDA-graph captures of the
        # decode, verification and drafter shapes): one stream and two, greedy and sampled, long enough to draft
        alone = [f"warm up\n{PROMPTS[0]}"]
        asyncio.run(measure_run(server.base_url, alone, 0.0, 16, 0, ignore_eos, args.request_timeout_s))
        asyncio.run(measure_run(server.base_url, ["Warm up", "Warm up again"], 0.0, 16, 0, ignore_eos,
                                args.request_timeout_s))
        asyncio.run(measure_run(server.base_url, alone, 1.0, 16, 0, ignore_eos, args.request_timeout_s))
    for temperature in temperatures:
        for num_streams in stream_counts:
            for repeat in range(args.repeats):
                # a per-run prefix keeps runs apart (a prefix-cache hit is checked too); the same
                # prompts go to every server, so greedy hashes are comparable
                nonce = f"t{temperature:g} s{num_streams} r{repeat}"
                prompts = [f"{nonce}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(num_streams)]
                order = servers[repeat % len(servers):] + servers[:repeat % len(servers)]
                for server in order:
                    key = f"{server.mode}/temperature={temperature:g}/streams={num_streams}"
                    if deadline_s is not None and time.monotonic() > deadline_s:
                        problems.append(f"{key} repeat {repeat}: not run (time budget {args.time_budget_s:g} s spent)")
                        print(f"SKIP {problems[-1]}", flush=True)
                        continue
                    print(f"run {key} repeat {repeat}", flush=True)
                    try:
                        run = asyncio.run(measure_run(server.base_url, prompts, temperature, args.max_tokens, 7,
                                                      ignore_eos, args.request_timeout_s))
                    except Exception as error:  # a timeout or an error reply: recorded, the rest still runs
                        problems.append(f"{key} repeat {repeat}: {type(error).__name__}: {str(error)[:200]}")
                        print(f"FAIL {problems[-1]}", flush=True)
                        continue
                    problems += run_problems(key, run, args.max_tokens, server.mode != "off", ignore_eos)
                    runs.setdefault(key, []).append({**run, "repeat": repeat})
                    _print_run(key, run)


def _summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per key the median run by tokens/s, with every repeat's tokens/s, texts and hashes beside it."""
    results = {}
    for key, repeats in runs.items():  # repeats in repeat order (same prompts across modes per repeat)
        ordered = sorted(repeats, key=lambda run: run["tokens_per_s"])
        results[key] = {**ordered[len(ordered) // 2], "repeat_tokens_per_s": [r["tokens_per_s"] for r in repeats],
                        "repeat_decode_tokens_per_s": [r["decode_tokens_per_s"] for r in repeats],
                        "repeat_texts": [r["texts"] for r in repeats], "repeat_ids": [r["repeat"] for r in repeats],
                        "repeat_hashes": [r["output_hash"] for r in repeats]}
    return results


def _cost_models(servers: list[Server]) -> dict[str, dict]:
    """What each adaptive server's router learned (spec_cost_model from /status.json), best effort."""
    import httpx

    models = {}
    for server in servers:
        try:
            engine = httpx.get(f"{server.base_url}/status.json", timeout=5).json().get("engine", {})
        except Exception:  # a server that died: nothing to read
            continue
        if "spec_cost_model" in engine:
            models[server.mode] = {"cost_model": engine["spec_cost_model"],
                                   "mean_survival": engine.get("spec_policy_mean_survival")}
    return models


def _keep_logs(servers: list[Server], target: Path) -> None:
    """Copy the tail of every service log of every server (device runs lose /tmp)."""
    for server in servers:
        directory = target / server.mode
        directory.mkdir(parents=True, exist_ok=True)
        for path in [server.run_dir / "serve.stderr", *sorted((server.run_dir / "logs").glob("*"))]:
            if path.is_file():
                (directory / path.name).write_bytes(path.read_bytes()[-200_000:])


def main(argv: list[str] | None = None) -> int:
    from moemesh.bench.results_io import describe_device, write_result

    args = parse_args(argv)
    ignore_eos = args.ignore_eos
    common = ["--devices", args.devices, "--dtype", args.dtype, "--drain-timeout", "5"]
    signal.signal(signal.SIGTERM, _terminate)  # a wall-clock cap still stops the servers and writes the JSON
    start_s = time.monotonic()
    deadline_s = start_s + args.time_budget_s if args.time_budget_s else None
    servers: list[Server] = []
    problems: list[str] = []
    runs: dict[str, list[dict]] = {}
    cost_models: dict[str, dict] = {}
    try:
        try:
            servers = [_launch(args.model, mode, _serve_args(mode, args.spec_width) + common)
                       for mode in args.mode_list]
            for server in servers:
                _await_ready(server)
            print(f"servers ready after {time.monotonic() - start_s:.1f} s: "
                  + "; ".join(s.first_line.strip() for s in servers), flush=True)
            _measure(servers, args, ignore_eos, problems, runs, deadline_s)
            cost_models = _cost_models(servers)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up and the JSON must not be cut again
            _stop_all(servers, timeout_s=8.0)
            if args.keep_logs:
                _keep_logs(servers, Path(args.keep_logs))
    except (SystemExit, KeyboardInterrupt) as error:
        problems.append(f"stopped early ({error or type(error).__name__}) after {time.monotonic() - start_s:.0f} s: "
                        "the runs finished so far are in this file")
    except RuntimeError as error:  # a server did not start
        problems.append(str(error)[:3000])
    results = _summarise(runs)
    summaries = {server.mode: _log_summaries(server.run_dir) for server in servers}
    for mode, summary in summaries.items():
        if summary:
            print(f"{mode:10s} inside the workers: {json.dumps(summary, sort_keys=True)}")
            _print_phase_medians(mode, summary.get("step_phases") or {})
    for mode, model in cost_models.items():
        print(f"{mode:10s} cost model learned by the router: {json.dumps(model, sort_keys=True)}")
    ratios = speedups(results, problems)
    for key, value in ratios.items():
        print(f"{key:44s} {value:.2f}x")
    raw = {"runs": results, "problems": problems, "max_tokens": args.max_tokens, "ignore_eos": ignore_eos,
           "modes": args.mode_list, "spec_width": args.spec_width, "repeats": args.repeats,
           "width_policies": {mode: WIDTH_POLICY[mode] for mode in args.mode_list},
           "worker_timings": summaries, "cost_models": cost_models,
           "serve_lines": {s.mode: s.first_line.strip() for s in servers}}
    path = write_result("speculation", raw, ratios, device=f"{describe_device()}; serve --devices {args.devices}",
                        command="moemesh bench speculation " + " ".join(argv if argv is not None else sys.argv[1:]),
                        out_dir=Path(args.out_dir) if args.out_dir else None,
                        tag="cpu" if all(d.strip() == "cpu" for d in args.devices.split(",")) else None)
    print(f"wrote {path}")
    for problem in problems:
        print(f"FAIL {problem}")
    return 1 if problems else 0


def _terminate(signum, _frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


if __name__ == "__main__":
    raise SystemExit(main())
