"""A small local plan builder for `moemesh generate --distributed` and the tests (not the router).

Requests are admitted in order into free slots; each step gives every running sequence the
next chunk of its known tokens (prompt chunks of at most `max_chunk_tokens`, then one token per
decode step), within `max_num_batched_tokens`. Blocks come from two free lists (primary, CPU).
When the primary pool cannot hold a sequence's next chunk, the most recently admitted running
sequence not yet scheduled in this step is swapped out to the CPU tier (it keeps its slot);
swapped sequences come back, oldest first, as soon as the primary pool can hold them until they
finish, so a sequence is never swapped twice for lack of room it will need anyway.

Invariant kept for the worker's move order (swap_out, then swap_in, both before compute): a CPU
block freed by a swap-in becomes reusable only from the next step, so a swap-out of the same
step never overwrites a block that is still to be read.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams
from common.wire.messages import ScheduledSequence, StepPlan, StepResult


class PlanError(RuntimeError):
    """The plan builder cannot make progress (a request larger than the pools, a worker error)."""


@dataclass(frozen=True)
class LocalPlanConfig:
    block_size_tokens: int = 128
    num_primary_blocks: int = 256
    num_cpu_blocks: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_chunk_tokens: int = 1024
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class LocalRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs per output token (when asked)
    num_computed: int = 0
    seq_slot: int | None = None
    primary_blocks: list[int] = field(default_factory=list)
    cpu_blocks: list[int] = field(default_factory=list)
    sent_params: bool = False
    finish_reason: str | None = None
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens


class LocalPlanner:
    def __init__(self, config: LocalPlanConfig, requests: list[LocalRequest]) -> None:
        self.config = config
        for request in requests:
            if not request.prompt_token_ids:
                raise PlanError(f"{request.request_id}: empty prompt")
            if self._blocks_for(request.max_total_tokens) > config.num_primary_blocks:
                raise PlanError(f"{request.request_id}: {request.max_total_tokens} tokens do not fit "
                                f"{config.num_primary_blocks} blocks of {config.block_size_tokens}")
        self.requests = list(requests)
        self.waiting = deque(requests)
        self.running: list[LocalRequest] = []
        self.swapped: deque[LocalRequest] = deque()
        self.free_primary = list(range(config.num_primary_blocks))
        self.free_cpu = list(range(config.num_cpu_blocks))
        self.free_slots = list(range(config.max_num_seqs))
        self._slots_to_free: list[int] = []
        self._step_id = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    @property
    def done(self) -> bool:
        return not (self.waiting or self.running or self.swapped)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size_tokens)

    # ------------------------------------------------------------------ planning
    def next_plan(self) -> StepPlan:
        swap_out, swap_in, cpu_freed_now = [], [], []
        self._swap_in_ready(swap_in, cpu_freed_now)
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            request.seq_slot = self.free_slots.pop(0)
            self.running.append(request)
        scheduled: list[tuple[LocalRequest, int]] = []
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if request not in self.running or budget == 0:
                continue
            num_new = min(len(request.token_ids) - request.num_computed, self.config.max_chunk_tokens, budget)
            need = self._blocks_for(request.num_computed + num_new) - len(request.primary_blocks)
            while need > len(self.free_primary):
                victim = next((r for r in reversed(self.running) if r is not request
                               and all(r is not s for s, _ in scheduled)), None)
                if victim is None or len(victim.primary_blocks) > len(self.free_cpu):
                    break
                self._swap_out(victim, swap_out)
            if need > len(self.free_primary):
                continue
            request.primary_blocks += [self.free_primary.pop(0) for _ in range(need)]
            scheduled.append((request, num_new))
            budget -= num_new
        if not scheduled and not swap_out and not swap_in and not self._slots_to_free:
            raise PlanError("no sequence can be scheduled (pools too small for the running sequences)")
        self.free_cpu += cpu_freed_now
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, sequences=tuple(self._wire(r, n) for r, n in scheduled),
                        swap_out=tuple(swap_out), swap_in=tuple(swap_in), free_seq_slots=tuple(self._slots_to_free))
        self.free_slots += self._slots_to_free  # reusable once the worker released them (after this plan)
        self._slots_to_free = []
        self._in_flight = {r.request_id: (r, n) for r, n in scheduled}
        return plan

    def _wire(self, request: LocalRequest, num_new: int) -> ScheduledSequence:
        start = request.num_computed
        sampling = None if request.sent_params else request.params.to_wire()
        request.sent_params = True
        return ScheduledSequence(
            request_id=request.request_id, seq_slot=request.seq_slot,
            token_ids=tuple(request.token_ids[start:start + num_new]), start_position=start,
            block_ids=(tuple(request.primary_blocks),), do_sample=start + num_new == len(request.token_ids),
            sampling=sampling, prior_token_ids=tuple(request.token_ids[:start]) if sampling else (),
            num_prompt_tokens=len(request.prompt_token_ids) if sampling else None)

    def _swap_out(self, victim: LocalRequest, swap_out: list) -> None:
        cpu = [self.free_cpu.pop(0) for _ in victim.primary_blocks]
        swap_out.extend(zip(victim.primary_blocks, cpu))
        self.free_primary += victim.primary_blocks
        victim.primary_blocks, victim.cpu_blocks = [], cpu
        self.running.remove(victim)
        self.swapped.append(victim)
        self.num_swapped_out += 1

    def _swap_in_ready(self, swap_in: list, cpu_freed_now: list) -> None:
        while self.swapped:
            request = self.swapped[0]
            if self._blocks_for(request.max_total_tokens) > len(self.free_primary):
                return
            primary = [self.free_primary.pop(0) for _ in request.cpu_blocks]
            swap_in.extend(zip(request.cpu_blocks, primary))
            cpu_freed_now += request.cpu_blocks
            request.primary_blocks, request.cpu_blocks = primary, []
            self.swapped.popleft()
            self.running.insert(0, request)  # oldest first again
            self.num_swapped_in += 1

    # ------------------------------------------------------------------ results
    def update(self, result: StepResult) -> None:
        for sequence in result.sequences:
            request, num_new = self._in_flight[sequence.request_id]
            if sequence.error is not None:
                request.error = sequence.error
                self._finish(request, "error")
                continue
            request.num_computed += num_new
            for token in sequence.token_ids:
                request.output_token_ids.append(token)
                if sequence.logprobs is not None:
                    request.logprobs.append(sequence.logprobs)
                reason = self._finish_reason(request, token)
                if reason is not None:
                    self._finish(request, reason)
                    break

    def _finish_reason(self, request: LocalRequest, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (token in self.config.eos_token_ids and not params.ignore_eos):
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        return None

    def _finish(self, request: LocalRequest, reason: str) -> None:
        request.finish_reason = reason
        self.running.remove(request)
        self.free_primary += request.primary_blocks
        request.primary_blocks = []
        self._slots_to_free.append(request.seq_slot)
