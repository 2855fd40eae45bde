"""Timing pieces of `bench.fullsize`: timestamps on the attention side, runs of plans, bandwidths.

- `TimedDispatcher` wraps the attention worker's `MoEDispatcher` (the runner calls only `start` and
  `finish`) and records, per MoE layer and micro-batch, the monotonic clock before the dispatch is
  built, after it is sent, and before/after waiting for the answers.
- `run_requests` drives the in-process `AttentionWorker` with `LocalPlanner` plans (the plans
  `moemesh generate --distributed` sends) and times every step (`worker.step` returns after the
  sampled tokens reached the host, so a step's wall time includes all its device work).
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


@dataclass
class StepTiming:
    step_id: int
    num_tokens: int
    num_sequences: int
    is_decode: bool
    began_s: float
    ended_s: float
    # speculation (zero in plain runs): drafts verified, accepted, tokens the sequences gained, and the
    # drafter round trip that produced this step's drafts (taken right before the step's plan)
    num_drafts: int = 0
    num_accepted: int = 0
    num_tokens_gained: int = 0
    draft_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.ended_s - self.began_s


@dataclass
class RunResult:
    steps: list[StepTiming] = field(default_factory=list)
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

    drafts: a draft source (`bench.fullsize_spec`): `drafts.propose(planner) -> seconds` is called
    before every plan and gives caught-up requests their drafts (`LocalPlanner.set_drafts`);
    `drafts.finish(planner)` at the end. send_features: every step asks the attention worker to send
    the requests' target features to its draft worker. num_top_logprobs: also keep each token's top
    alternatives (and its logprob), a diagnostic of speculative runs (`bench.fullsize_spec`).

    before_decode(): called once, right before the first step that is all decode (the context is in
    the KV cache by then). stop_after(result) -> bool: asked after every decode step; True finishes
    every request there (their slots are released by one more, empty plan) and marks the result
    `stopped_early` — a time cap on slow configurations that keeps the steps measured so far."""
    from moemesh.common.wire.messages import ErrorReply
    from moemesh.services.attention.local_plan import LocalPlanConfig, LocalPlanner, LocalRequest, PlanError

    num_logprobs = num_top_logprobs if num_top_logprobs is not None else (0 if with_logprobs else None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, num_logprobs=num_logprobs)
    requests = [LocalRequest(f"{prefix}-{i}", list(p), params, send_features=send_features)
                for i, p in enumerate(prompts)]
    plan_config = LocalPlanConfig(block_size_tokens=block_size_tokens, num_primary_blocks=num_primary_blocks,
                                  max_num_seqs=max(64, len(prompts)), max_num_batched_tokens=max_batched_tokens,
                                  max_chunk_tokens=max_batched_tokens)
    planner = LocalPlanner(plan_config, requests)
    result = RunResult()
    prompt_lengths = {r.request_id: len(r.prompt_token_ids) for r in requests}
    while not planner.done:
        draft_s = drafts.propose(planner) if drafts is not None else 0.0
        plan = planner.next_plan()
        num_tokens = sum(len(s.token_ids) for s in plan.sequences)
        is_decode = all(s.start_position >= prompt_lengths[s.request_id] for s in plan.sequences)
        if is_decode and before_decode is not None:
            before_decode()
            before_decode = None
        began_s = time.perf_counter()
        reply = worker.step(plan)
        ended_s = time.perf_counter()
        if isinstance(reply, ErrorReply):
            raise PlanError(f"attention worker: {reply.code}: {reply.message}")
        planner.update(reply)
        result.steps.append(StepTiming(
            plan.step_id, num_tokens, len(plan.sequences), is_decode, began_s, ended_s,
            num_drafts=sum(len(s.draft_token_ids) for s in plan.sequences),
            num_accepted=sum(s.num_draft_accepted for s in reply.sequences),
            num_tokens_gained=sum(len(s.token_ids) for s in reply.sequences), draft_s=draft_s))
        if on_step is not None:
            on_step(result.steps[-1])
        if is_decode and stop_after is not None and not planner.done and stop_after(result):
            _stop_all(worker, planner)
            result.stopped_early = True
            break
    if drafts is not None:
        drafts.finish(planner)
    for request in requests:
        if request.error is not None:
            raise PlanError(f"{request.request_id}: {request.error}")
        result.outputs[request.request_id] = list(request.output_token_ids)
        result.logprobs[request.request_id] = [entry.logprobs[0] for entry in request.logprobs]
        if num_top_logprobs:
            result.top_logprobs[request.request_id] = [
                (tuple(entry.top_token_ids[0]), tuple(entry.top_logprobs[0])) if entry.top_token_ids else ((), ())
                for entry in request.logprobs]
    return result


def _stop_all(worker, planner) -> None:
    """Finish every running request now and send the plan that releases their slots."""
    from moemesh.common.wire.messages import ErrorReply

    for request in list(planner.running):
        planner._finish(request, "length")
    plan = planner.next_plan()  # no sequences, only free_seq_slots
    reply = worker.step(plan)
    if isinstance(reply, ErrorReply):
        raise RuntimeError(f"attention worker refused the releasing plan: {reply.code}: {reply.message}")


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
