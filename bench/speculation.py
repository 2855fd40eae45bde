"""`moemesh bench speculation`: tokens/s with and without DSpark speculation, in one run.

Starts `moemesh serve` twice on the same model (speculation off, then the chosen mode), and for
temperature 0 and 1, one stream and N streams, sends the same completions and measures output
tokens per second (wall clock over the batch), plus the mean accepted length per verify step
(bonus included) from each response's usage.speculative.

Deterministic decode check (in the manner of Lucebox's bench_ds4_decode.py); the benchmark exits 1
when any holds:
- a run is short: a request produced no token, or ended as "length" before max_tokens (ending
  on EOS is allowed: the gateway has no ignore_eos);
- a request hit a cached prefix (usage.prompt_tokens_details.cached_tokens > 0);
- a run had zero throughput;
- greedy outputs (sha256 over every request's text) differ between speculation and plain;
- speculation did not run in a speculative run (no request with usage.speculative.ran).
Prompts carry a per-run nonce so no run reuses another's prefix. Writes
`bench/results/speculation-<time>.json` (bench.results_io). Speed is printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "In the beginning God created", "And the LORD said unto Moses,", "Blessed are the poor in spirit:",
    "The LORD is my shepherd;", "For God so loved the world,", "And it came to pass, when", "Now the serpent was",
    "Thus saith the LORD of hosts;",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(model: str, run_dir: Path, args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [sys.executable, "-m", "common.cli", "serve", "--model", model, "--port", str(port), "--run-dir",
               str(run_dir), *args]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=env)
    line = process.stdout.readline()
    if "moemesh serving" not in line:
        process.kill()
        raise RuntimeError(f"serve {' '.join(args)} did not start: {line!r} (logs in {run_dir})")
    return process, f"http://127.0.0.1:{port}"


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


async def _run(base_url: str, prompts: list[str], temperature: float, max_tokens: int, seed: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(index: int, prompt: str) -> dict:
            body = {"model": "moemesh", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                    "seed": seed + index}
            reply = await client.post(f"{base_url}/v1/completions", json=body)
            reply.raise_for_status()
            return reply.json()

        start_s = time.perf_counter()
        replies = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        elapsed_s = time.perf_counter() - start_s
    num_tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    spec = [r["usage"].get("speculative") or {} for r in replies]
    accepted_lengths = [s["mean_accepted_length"] for s in spec if s.get("ran")]
    return {
        "num_requests": len(prompts), "num_output_tokens": num_tokens, "elapsed_s": elapsed_s,
        "tokens_per_s": num_tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "speculation_ran": any(s.get("ran") for s in spec),
        "draft_tokens": sum(s.get("draft_tokens", 0) for s in spec),
        "accepted_tokens": sum(s.get("accepted_tokens", 0) for s in spec),
        "mean_accepted_length": sum(accepted_lengths) / len(accepted_lengths) if accepted_lengths else 0.0,
        "cached_tokens": sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in replies),
        "finish_reasons": [r["choices"][0]["finish_reason"] for r in replies],
        "completion_tokens": [r["usage"]["completion_tokens"] for r in replies],
        "output_hash": hashlib.sha256("\x00".join(r["choices"][0]["text"] for r in replies).encode()).hexdigest(),
    }


def _checks(name: str, run: dict, max_tokens: int, speculative: bool) -> list[str]:
    problems = []
    for reason, count in zip(run["finish_reasons"], run["completion_tokens"]):
        if count == 0 or (reason == "length" and count != max_tokens):  # ended early without EOS / stop
            problems.append(f"{name}: short request ({count} tokens, finish {reason})")
    if any(reason not in ("length", "stop") for reason in run["finish_reasons"]):
        problems.append(f"{name}: finish reasons {run['finish_reasons']}")
    if run["cached_tokens"]:
        problems.append(f"{name}: hit a cached prefix ({run['cached_tokens']} tokens)")
    if run["tokens_per_s"] <= 0:
        problems.append(f"{name}: zero throughput")
    if speculative and not run["speculation_ran"]:
        problems.append(f"{name}: speculation did not run")
    return problems


def main(argv: list[str] | None = None) -> int:
    from bench.results_io import write_result

    parser = argparse.ArgumentParser(prog="moemesh bench speculation")
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "kjv-dsv4-mini"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--speculation", default="adaptive", choices=("fixed", "adaptive"))
    parser.add_argument("--spec-width", type=int, default=None)
    parser.add_argument("--devices", default="cpu")
    args = parser.parse_args(argv)
    spec_args = ["--speculation", args.speculation] + (["--spec-width", str(args.spec_width)] if args.spec_width else [])
    modes = {"plain": ["--speculation", "off"], "spec": spec_args}
    results: dict[str, dict] = {}
    problems: list[str] = []
    for mode, serve_args in modes.items():
        process, base_url = _start(args.model, Path(tempfile.mkdtemp(prefix=f"bench-spec-{mode}-")),
                                   serve_args + ["--devices", args.devices])
        try:
            asyncio.run(_run(base_url, ["Warm up"], 0.0, 4, 0))  # first-step costs out of the figures
            for temperature in (0.0, 1.0):
                for num_streams in (1, args.streams):
                    # a per-run prefix keeps runs of one server apart (a prefix-cache hit is checked too);
                    # the same prompts go to both servers, so greedy hashes are comparable
                    nonce = f"t{temperature:g} s{num_streams}"
                    prompts = [f"{nonce}: {PROMPTS[i % len(PROMPTS)]}" for i in range(num_streams)]
                    run = asyncio.run(_run(base_url, prompts, temperature, args.max_tokens, 7))
                    key = f"{mode}/temperature={temperature:g}/streams={num_streams}"
                    results[key] = run
                    problems += _checks(key, run, args.max_tokens, mode == "spec")
                    print(f"{key:40s} {run['tokens_per_s']:8.2f} tok/s  tokens {run['num_output_tokens']:5d}  "
                          f"mean accepted length {run['mean_accepted_length']:.2f}  drafts {run['draft_tokens']}")
        finally:
            _stop(process)
    ratios = {}
    for temperature in (0.0, 1.0):
        for num_streams in (1, args.streams):
            suffix = f"temperature={temperature:g}/streams={num_streams}"
            plain, spec = results[f"plain/{suffix}"], results[f"spec/{suffix}"]
            ratios[f"speedup/{suffix}"] = spec["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0
            if temperature == 0.0 and plain["output_hash"] != spec["output_hash"]:
                problems.append(f"greedy output hash differs with speculation ({suffix})")
    for key, value in ratios.items():
        print(f"{key:40s} {value:.2f}x")
    path = write_result("speculation", {"runs": results, "problems": problems, "max_tokens": args.max_tokens},
                        ratios, device=args.devices, command="moemesh bench speculation " + " ".join(argv or []))
    print(f"wrote {path}")
    for problem in problems:
        print(f"FAIL {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
