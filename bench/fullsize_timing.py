"""Timing pieces of `bench.fullsize`: timestamps on the attention side, runs of plans, bandwidths.

- `TimedDispatcher` wraps the attention worker's `MoEDispatcher` (the runner calls only `start` and
  `finish`) and records, per MoE layer and micro-batch, the monotonic clock before the dispatch is
  built, after it is sent, and before/after waiting for the answers.
- `run_requests` drives the in-process `AttentionWorker` with the router's scheduler
  (`services.router.offline_engine`, as `moemesh generate --distributed` does) and times every step
  (`worker.step` returns after the sampled tokens reached the host, so a step's wall time includes
  all its device work).
- `copy_bandwidth`: bytes read + written per second of a large device-to-device copy (CUDA: events;
  CPU: all of torch's threads), the denominator of every weight-bandwidth floor.
Legend: B sequences, L layers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moemesh.bench.timing import median, time_s
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.offline_engine import StepRecord


class TimedDispatcher:
    """Delegates to a MoEDispatcher; `records` rows: [step_id, layer, micro_batch, start_begin_s,
    start_end_s, finish_begin_s, finish_end_s] (time.perf_counter)."""

    def __init__(self, inner) -> None:
        from moemesh.bench.fullsize_verify import DispatchTrace

        self.inner = inner
        self.records: list[list[float]] = []
        self._open: dict[int, list[float]] = {}
        self.trace = DispatchTrace()  # the last tickets, to explain a refused Dispatch

    def start(self, step_id, micro_batch, layer, x, ids, weights):
        began_s = time.perf_counter()
        ticket = self.inner.start(step_id, micro_batch, layer, x, ids, weights)
        self._open[id(ticket)] = [step_id, layer, micro_batch, began_s, time.perf_counter()]
        self.trace.add(step_id, layer, ids, ticket)
        return ticket

    def finish(self, ticket):
        began_s = time.perf_counter()
        routed = self.inner.finish(ticket)
        row = self._open.pop(id(ticket))
        self.records.append(row + [began_s, time.perf_counter()])
        return routed

    def __getattr__(self, name):  # everything else (tables, counters) is the real dispatcher's
        return getattr(self.inner, name)


@dataclass(frozen=True)
class TimedStep(StepRecord):
    """The engine's record of one step, plus the drafter round trip that produced its drafts (taken
    right before the step)."""

    draft_s: float = 0.0


@dataclass
class RunResult:
    steps: list[TimedStep] = field(default_factory=list)
    stopped_early: bool = False  # `stop_after` ended the decode before max_tokens (outputs are then partial)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # request id -> generated tokens
    logprobs: dict[str, list[float]] = field(default_factory=dict)  # chosen-token logprobs (when asked)
    # per token: (top token ids, their logprobs), when num_top_logprobs was asked
    top_logprobs: dict[str, list[tuple[tuple[int, ...], tuple[float, ...]]]] = field(default_factory=dict)


def random_prompts(num_prompts: int, num_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (num_prompts, num_tokens), generator=generator).tolist()


def run_requests(worker, prompts: list[list[int]], max_tokens: int, *, block_size_tokens: int,
                 num_primary_blocks: int, max_batched_tokens: int, with_logprobs: bool = False,
                 prefix: str = "req", on_step=None, before_decode=None, stop_after=None, drafts=None,
                 send_features: bool = False, num_top_logprobs: int | None = None) -> RunResult:
    """Greedy-generate `max_tokens` for every prompt through `worker.step`, timing each step.

    The router's scheduler plans the steps (`services.router.offline_engine`, as `moemesh generate
    --distributed` runs; prefix caching off, so every run computes its whole context) and each
    `StepRecord` carries the step's wall time (`worker.step` returns after the sampled tokens reached
    the host, so it includes all the step's device work).

    drafts: a draft source (`bench.fullsize_spec`): `drafts.propose(engine) -> seconds` is called
    before every step and gives caught-up requests their drafts (`OfflineEngine.set_drafts`);
    `drafts.finish(engine)` at the end. send_features: every step asks the attention worker to send
    the requests' target features to its draft worker. num_top_logprobs: also keep each token's top
    alternatives (and its logprob), a diagnostic of speculative runs (`bench.fullsize_spec`).

    before_decode(): called once, right before the first step that is all decode (the context is in
    the KV cache by then). stop_after(result) -> bool: asked after every decode step; True finishes
    every request there (their slots are released by one more, empty plan) and marks the result
    `stopped_early` — a time cap on slow configurations that keeps the steps measured so far."""
    from moemesh.services.router.offline_engine import OfflineEngine, is_decode
    from moemesh.services.router.scheduler import SchedulerConfig

    num_logprobs = num_top_logprobs if num_top_logprobs is not None else (0 if with_logprobs else None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, num_logprobs=num_logprobs)
    config = SchedulerConfig(num_gpu_blocks=num_primary_blocks, max_model_len=num_primary_blocks * block_size_tokens,
                             block_size_tokens=block_size_tokens, max_num_running_seqs=max(64, len(prompts)),
                             max_num_batched_tokens=max_batched_tokens, long_prefill_token_threshold=max_batched_tokens,
                             enable_prefix_caching=False)
    engine = OfflineEngine(config, worker.step, send_features=send_features)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}-{index}", prompt, params)
    result = RunResult()
    pending = [before_decode] if before_decode is not None else []

    def before_execute(output) -> None:
        if pending and is_decode(output):
            pending.pop()()

    while not engine.done:
        draft_s = drafts.propose(engine) if drafts is not None else 0.0
        record = TimedStep(**vars(engine.step(before_execute)), draft_s=draft_s)
        result.steps.append(record)
        if on_step is not None:
            on_step(record)
        if record.is_decode and stop_after is not None and not engine.done and stop_after(result):
            engine.abort_all()
            result.stopped_early = True
    engine.release_slots()
    if drafts is not None:
        drafts.finish(engine)
    for request_id, output in engine.outputs.items():
        if output.error is not None:
            raise RuntimeError(f"{request_id}: {output.error}")
        result.outputs[request_id] = list(output.output_token_ids)
        result.logprobs[request_id] = [entry.logprobs[0] for entry in output.logprobs]
        if num_top_logprobs:
            result.top_logprobs[request_id] = [
                (tuple(entry.top_token_ids[0]), tuple(entry.top_logprobs[0])) if entry.top_token_ids else ((), ())
                for entry in output.logprobs]
    return result


def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes read + written per second of a `num_bytes` copy on `device` (median of `reps`)."""
    if device.type == "cuda":
        with torch.cuda.device(device):  # events and the copy on that device's stream
            return _copy_bandwidth(device, num_bytes, reps)
    return _copy_bandwidth(device, num_bytes, reps)


def _copy_bandwidth(device: torch.device, num_bytes: int, reps: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    src.fill_(7)
    dst = torch.empty_like(src)
    return 2 * num_bytes / median(time_s(lambda: dst.copy_(src), device, warmup=1, repeats=reps))


def flush_expert_timings(endpoints: dict[str, str], timing_dir, timeout_s: float = 30.0) -> dict[str, dict]:
    """Ask every expert worker for its inventory (which writes its dispatch records), read them back."""
    import json

    import zmq

    from moemesh.common.wire.messages import QueryInventory
    from moemesh.common.wire.transport import SyncClient

    context = zmq.Context()
    out = {}
    try:
        for name, endpoint in endpoints.items():
            client = SyncClient(endpoint, context=context)
            try:
                client.request(QueryInventory(), timeout_s=timeout_s)
            finally:
                client.close()
            out[name] = json.loads((timing_dir / f"{name}.json").read_text(encoding="utf-8"))
    finally:
        context.term()
    return out
