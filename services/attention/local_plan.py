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

Speculation (as the router's scheduler does it, services/router/scheduler/budget.py): drafts given
with `set_drafts` ride along when the request has caught up (one known token left, the seed), never
past max_tokens (verifying k drafts yields up to k + 1 tokens), within the step budget and the
chunk cap; they count in the budget and get blocks like known tokens. After the step the request
takes the accepted drafts + the bonus (`SequenceResult.num_draft_accepted`), only the seed and the
accepted drafts count as computed, and the blocks past the computed tokens (rejected drafts') go
back to the free list. The attention worker rolls its own state back. Drafts are used for one step
only, and a request that is not scheduled in a step keeps its drafts for the next.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import ScheduledSequence, StepPlan, StepResult, TokenLogprobs


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
    # speculation: drafts for the next step (after the seed), with each sampled draft's sparse q
    draft_token_ids: list[int] = field(default_factory=list)
    draft_support_token_ids: tuple[tuple[int, ...], ...] = ()
    draft_support_probs: tuple[tuple[float, ...], ...] = ()
    send_features: bool = False  # ask the attention worker to send this request's features to the drafter
    num_verify_steps: int = 0  # steps that verified at least one draft of this request
    num_draft_tokens: int = 0  # drafts verified, over all steps
    num_draft_accepted: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def is_caught_up(self) -> bool:
        """Only the seed (the newest known token) is left to compute: the step that may carry drafts."""
        return self.finish_reason is None and len(self.token_ids) - self.num_computed == 1

    @property
    def max_drafts(self) -> int:
        """Drafts the next step may verify without passing max_tokens (0 once none can)."""
        return max(0, self.params.max_tokens - len(self.output_token_ids) - 1)


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
        self._by_id = {r.request_id: r for r in requests}
        if len(self._by_id) != len(self.requests):
            raise PlanError("request ids must be unique")
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

    def get(self, request_id: str) -> LocalRequest:
        return self._by_id[request_id]

    def set_drafts(self, request_id: str, token_ids, support_token_ids=(), support_probs=()) -> None:
        """Drafts for the request's next step (replacing any it had). support_*[i]: the sparse
        distribution draft i was drawn from (sampled requests; empty for greedy ones)."""
        request = self._by_id[request_id]
        token_ids = [int(t) for t in token_ids]
        if support_token_ids and not (len(support_token_ids) == len(support_probs) == len(token_ids)):
            raise PlanError(f"{request_id}: {len(token_ids)} drafts, {len(support_token_ids)} supports, "
                            f"{len(support_probs)} probability rows")
        if not request.params.is_greedy and token_ids and not support_token_ids:
            raise PlanError(f"{request_id}: a sampled request's drafts need the distributions they were drawn from")
        request.draft_token_ids = token_ids
        request.draft_support_token_ids = tuple(tuple(int(t) for t in ids) for ids in support_token_ids)
        request.draft_support_probs = tuple(tuple(float(p) for p in probs) for probs in support_probs)

    # ------------------------------------------------------------------ planning
    def next_plan(self) -> StepPlan:
        swap_out, swap_in, cpu_freed_now = [], [], []
        self._swap_in_ready(swap_in, cpu_freed_now)
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            request.seq_slot = self.free_slots.pop(0)
            self.running.append(request)
        scheduled: list[tuple[LocalRequest, int, int]] = []  # (request, tokens to compute, of them drafts)
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if request not in self.running or budget == 0:
                continue
            num_new, num_drafts = self._num_to_compute(request, budget)
            need = self._blocks_for(request.num_computed + num_new) - len(request.primary_blocks)
            while need > len(self.free_primary):
                victim = next((r for r in reversed(self.running) if r is not request
                               and all(r is not s for s, _, _ in scheduled)), None)
                if victim is None or len(victim.primary_blocks) > len(self.free_cpu):
                    break
                self._swap_out(victim, swap_out)
            if need > len(self.free_primary):
                continue
            request.primary_blocks += [self.free_primary.pop(0) for _ in range(need)]
            scheduled.append((request, num_new, num_drafts))
            budget -= num_new
        if not scheduled and not swap_out and not swap_in and not self._slots_to_free:
            raise PlanError("no sequence can be scheduled (pools too small for the running sequences)")
        self.free_cpu += cpu_freed_now
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, sequences=tuple(self._wire(r, n, d) for r, n, d in scheduled),
                        swap_out=tuple(swap_out), swap_in=tuple(swap_in), free_seq_slots=tuple(self._slots_to_free))
        self.free_slots += self._slots_to_free  # reusable once the worker released them (after this plan)
        self._slots_to_free = []
        self._in_flight = {r.request_id: (r, n, d) for r, n, d in scheduled}
        return plan

    def _num_to_compute(self, request: LocalRequest, budget: int) -> tuple[int, int]:
        """(tokens to compute this step, how many of them are drafts): known tokens first (capped
        by the chunk and the budget), drafts only once caught up and only as many as fit."""
        num_remaining = len(request.token_ids) - request.num_computed
        num_drafts = min(len(request.draft_token_ids), request.max_drafts) if num_remaining == 1 else 0
        num_new = min(num_remaining + num_drafts, self.config.max_chunk_tokens, budget)
        return num_new, max(0, min(num_drafts, num_new - num_remaining))

    def _wire(self, request: LocalRequest, num_new: int, num_drafts: int) -> ScheduledSequence:
        start = request.num_computed
        num_known = num_new - num_drafts
        sampling = None if request.sent_params else request.params.to_wire()
        request.sent_params = True
        drafts = tuple(request.draft_token_ids[:num_drafts])
        return ScheduledSequence(
            request_id=request.request_id, seq_slot=request.seq_slot,
            token_ids=tuple(request.token_ids[start:start + num_known]) + drafts, start_position=start,
            block_ids=(tuple(request.primary_blocks),), do_sample=start + num_known == len(request.token_ids),
            sampling=sampling, prior_token_ids=tuple(request.token_ids[:start]) if sampling else (),
            num_prompt_tokens=len(request.prompt_token_ids) if sampling else None,
            draft_token_ids=drafts, draft_support_token_ids=request.draft_support_token_ids[:num_drafts] if drafts else (),
            draft_support_probs=request.draft_support_probs[:num_drafts] if drafts else (),
            send_features=request.send_features)

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
        """Apply a step's results: tokens gained, rejected drafts uncounted and their blocks freed."""
        for sequence in result.sequences:
            request, num_new, num_drafts = self._in_flight[sequence.request_id]
            if num_drafts:  # used for this step only, whatever the outcome
                request.draft_token_ids, request.draft_support_token_ids, request.draft_support_probs = [], (), ()
            if sequence.error is not None:
                request.error = sequence.error
                self._finish(request, "error")
                continue
            num_accepted = sequence.num_draft_accepted
            if not 0 <= num_accepted <= num_drafts or (num_drafts and len(sequence.token_ids) != num_accepted + 1):
                raise PlanError(f"{request.request_id}: {len(sequence.token_ids)} tokens and {num_accepted} accepted "
                                f"for {num_drafts} drafts")
            if num_drafts:
                request.num_verify_steps += 1
                request.num_draft_tokens += num_drafts
                request.num_draft_accepted += num_accepted
            request.num_computed += num_new - (num_drafts - num_accepted)  # the seed + accepted drafts
            self._release_blocks_past(request, request.num_computed)
            for index, token in enumerate(sequence.token_ids):
                request.output_token_ids.append(token)
                if sequence.logprobs is not None:
                    request.logprobs.append(_token_logprobs(sequence.logprobs, index))
                reason = self._finish_reason(request, token)
                if reason is not None:
                    self._finish(request, reason)
                    break

    def _release_blocks_past(self, request: LocalRequest, num_tokens: int) -> None:
        """Blocks holding no computed token (those of rejected drafts) go back to the free list."""
        num_kept = self._blocks_for(num_tokens)
        if len(request.primary_blocks) > num_kept:
            self.free_primary += request.primary_blocks[num_kept:]
            del request.primary_blocks[num_kept:]

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
        request.draft_token_ids, request.draft_support_token_ids, request.draft_support_probs = [], (), ()
        self._slots_to_free.append(request.seq_slot)


def _token_logprobs(logprobs: TokenLogprobs, index: int) -> TokenLogprobs:
    """Entry `index` of a step's TokenLogprobs (one entry per token it gained) as its own TokenLogprobs."""
    if len(logprobs.logprobs) == 1 and index == 0:
        return logprobs
    return TokenLogprobs(logprobs=(logprobs.logprobs[index],),
                         top_token_ids=(logprobs.top_token_ids[index],) if logprobs.top_token_ids else (),
                         top_logprobs=(logprobs.top_logprobs[index],) if logprobs.top_logprobs else ())
