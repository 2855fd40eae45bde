"""Router-side scheduler cost: microseconds per schedule() + update() at 1, 64 and 256 running sequences.

The router runs the scheduler between its awaits, so its cost adds to every step's latency
(a decode step of the whole model is a few milliseconds). This measures steady-state decode:
N requests with 512-token prompts all running, prefix caching on, optionally with drafts
to verify (all accepted, so every step also appends several tokens per request). Only the
two scheduler calls are timed; building the fake results in between is not.

    python -m moemesh.bench.scheduler_cost [--num-steps 400] [--num-drafts 0 4] [--seqs 1 64 256]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from moemesh.bench.results_io import write_result
from moemesh.bench.timing import median, percentile
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.scheduler import Request, Scheduler, SchedulerConfig, SequenceResult

PROMPT_TOKENS = 512
MAX_MODEL_LEN = 1 << 16


def build_scheduler(num_seqs: int, num_steps: int, num_drafts: int) -> Scheduler:
    tokens_per_seq = PROMPT_TOKENS + (num_steps + 64) * (num_drafts + 1)
    config = SchedulerConfig(
        num_gpu_blocks=max(num_seqs * (tokens_per_seq // 128 + 2), MAX_MODEL_LEN // 128),
        max_model_len=MAX_MODEL_LEN,
        max_num_running_seqs=256,
        max_num_batched_tokens=max(2048, num_seqs * (num_drafts + 1)),
    )
    scheduler = Scheduler(config)
    rng = random.Random(num_seqs)
    for index in range(num_seqs):
        prompt = tuple(rng.randrange(100_000) for _ in range(PROMPT_TOKENS))
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - PROMPT_TOKENS - 1, ignore_eos=True)
        scheduler.add_request(Request(f"r{index}", prompt, params))
    return scheduler


def fake_results(plan, next_token: int) -> dict[str, SequenceResult]:
    """Every draft accepted, plus a bonus token."""
    return {
        seq.request_id: SequenceResult(seq.draft_token_ids + (next_token,), len(seq.draft_token_ids))
        for seq in plan.scheduled
        if seq.sample_logits
    }


def measure(num_seqs: int, num_steps: int, num_drafts: int) -> list[float]:
    """Per-step cost in microseconds, after all prompts are prefilled."""
    scheduler = build_scheduler(num_seqs, num_steps, num_drafts)
    drafts = list(range(7, 7 + num_drafts))
    request_ids = [f"r{index}" for index in range(num_seqs)]
    # Warm-up: prefill every prompt until each request decodes.
    while scheduler.stats().num_waiting_requests or any(
        scheduler.get_request(rid).num_output_tokens == 0 for rid in request_ids
    ):
        plan = scheduler.schedule()
        scheduler.update(plan, fake_results(plan, 5))
    costs_us = []
    for step in range(num_steps):
        start = time.perf_counter()
        if num_drafts:
            for request_id in request_ids:
                scheduler.set_draft_tokens(request_id, drafts)
        plan = scheduler.schedule()
        scheduled = time.perf_counter()
        results = fake_results(plan, step % 1000)
        resumed = time.perf_counter()
        scheduler.update(plan, results)
        done = time.perf_counter()
        assert len(plan.scheduled) == num_seqs
        costs_us.append(((scheduled - start) + (done - resumed)) * 1e6)
    return costs_us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.scheduler_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--num-steps", type=int, default=400)
    parser.add_argument("--num-drafts", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--no-write", action="store_true", help="print only, write no result file")
    args = parser.parse_args(argv)

    raw: dict[str, dict[str, float]] = {}
    print(f"{'running seqs':>12} {'drafts':>6} {'median us':>10} {'p90 us':>10} {'us/seq':>8}")
    for num_drafts in args.num_drafts:
        for num_seqs in args.seqs:
            costs = measure(num_seqs, args.num_steps, num_drafts)
            median_us, p90 = median(costs), percentile(costs, 0.9)
            raw[f"seqs_{num_seqs}_drafts_{num_drafts}"] = {
                "num_running_seqs": num_seqs,
                "num_drafts": num_drafts,
                "num_steps": args.num_steps,
                "median_us": round(median_us, 2),
                "p90_us": round(p90, 2),
            }
            print(f"{num_seqs:>12} {num_drafts:>6} {median_us:>10.1f} {p90:>10.1f} {median_us / num_seqs:>8.2f}")
    ratios = {}
    for num_drafts in args.num_drafts:
        low, high = raw.get(f"seqs_1_drafts_{num_drafts}"), raw.get(f"seqs_256_drafts_{num_drafts}")
        if low and high:
            ratios[f"median_256_over_1_drafts_{num_drafts}"] = round(high["median_us"] / low["median_us"], 2)
    if not args.no_write:
        device = f"CPU {platform.processor() or platform.machine()} (pure Python {platform.python_version()})"
        path = write_result("scheduler", raw, ratios, device=device, tag="cpu")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
