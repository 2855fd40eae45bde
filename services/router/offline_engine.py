"""The router's scheduler driving an attention worker in-process, without the HTTP gateway.

`OfflineEngine` takes requests (prompt token ids + SamplingParams), and each `step()` is the
serving loop's schedule -> execute -> update (services/router/engine.py) with the same pieces:
`Scheduler`, `PlanTranslator` (SchedulerOutput -> StepPlans) and `translate_result`. The worker
is any callable `execute(StepPlan) -> StepResult | ErrorReply`: an in-process attention worker's
step, or `RemoteAttention` (a socket to an attention worker process). It serves
`moemesh generate --distributed` and the full-size benchmark, which reads the per-step timing
from each `StepRecord` (wall clock around the worker's call, tokens, drafts verified and accepted).

Speculation: `set_drafts` gives a caught-up request drafts for its next step (the scheduler keeps
them within max_tokens and the step budget); `draft_candidates` lists the requests that may take
some. A refused or mismatched step raises `EngineStepError`; a sequence the worker reports as
failed ends alone (its output's `error`). Imports no torch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import ErrorReply, StepPlan, StepResult, TokenLogprobs
from moemesh.services.router.engine_plan import PlanTranslator, TranslatedResult, translate_result
from moemesh.services.router.scheduler import (Request, RequestEvent, RequestStatus, Scheduler, SchedulerConfig,
                                               SchedulerOutput)
from moemesh.services.router.scheduler.stop_checks import max_output_tokens

StepExecutor = Callable[[StepPlan], "StepResult | ErrorReply"]


class EngineStepError(RuntimeError):
    """The attention worker refused a step or answered something else than a StepResult."""


@dataclass
class RequestOutput:
    """What one request produced: its tokens, per-token logprobs (when asked), how it ended."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one entry per output token
    finish_reason: str | None = None  # stop | length | abort | deadline | error
    error: str | None = None
    num_draft_tokens: int = 0  # drafts verified, over all steps
    num_accepted_drafts: int = 0


@dataclass(frozen=True)
class StepRecord:
    """One scheduler step: its timing (time.perf_counter around the worker's calls) and outcome.
    step_id: the StepPlan that carried the step's sequences (the worker's step id; 0: nothing sent)."""

    step_id: int
    num_tokens: int
    num_sequences: int
    is_decode: bool  # every scheduled sequence is past its prompt
    began_s: float
    ended_s: float
    num_drafts: int
    num_accepted: int
    num_tokens_gained: int
    events: tuple[RequestEvent, ...]

    @property
    def wall_s(self) -> float:
        return self.ended_s - self.began_s


class OfflineEngine:
    def __init__(self, config: SchedulerConfig, execute: StepExecutor, *, eos_token_ids: tuple[int, ...] = (),
                 send_features: bool = False) -> None:
        """send_features: every scheduled sequence asks the attention worker to send its target
        features to the draft worker."""
        self.scheduler = Scheduler(config)
        self.translator = PlanTranslator()
        self.execute = execute
        self.eos_token_ids = tuple(eos_token_ids)
        self.send_features = send_features
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, RequestOutput] = {}
        self._idle = False  # the last step had nothing for the worker

    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams) -> RequestOutput:
        """Queue a request; ValueError if it can never run (empty, duplicate, past max_model_len)."""
        request = Request(request_id, tuple(int(t) for t in prompt_token_ids), params,
                          arrival_time_s=time.monotonic(), eos_token_ids=self.eos_token_ids)
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        self.outputs[request_id] = RequestOutput(request_id, request.prompt_token_ids)
        return self.outputs[request_id]

    @property
    def done(self) -> bool:
        return self.scheduler.num_unfinished_requests == 0

    def draft_candidates(self) -> list[tuple[Request, int]]:
        """(request, most drafts its next step may verify) for every running request that has
        caught up (only its newest token to compute), holds no drafts, and may still take one."""
        candidates = []
        for request in self.requests.values():
            if request.status is not RequestStatus.RUNNING or request.draft_token_ids:
                continue
            if request.num_tokens - request.num_computed_tokens != 1:
                continue
            limit = max_output_tokens(request, self.scheduler.config.max_model_len)
            num_drafts = limit - request.num_output_tokens - 1
            if num_drafts > 0:
                candidates.append((request, num_drafts))
        return candidates

    def set_drafts(self, request_id: str, token_ids) -> None:
        self.scheduler.set_draft_tokens(request_id, [int(t) for t in token_ids])

    def abort_all(self) -> None:
        """End every unfinished request; the next step releases their slots on the worker."""
        for request_id in list(self.requests):
            event = self.scheduler.abort(request_id)
            if event is not None:
                self._record(event, None)

    # -- one step ------------------------------------------------------------------------
    def step(self, before_execute: Callable[[SchedulerOutput], None] | None = None) -> StepRecord:
        """Schedule, execute the plan(s) on the worker, apply the results. before_execute(output):
        called between scheduling and the worker's call (not timed)."""
        output = self.scheduler.schedule()
        self._idle = output.is_empty
        if before_execute is not None:
            before_execute(output)
        result = TranslatedResult({}, {})
        began_s = ended_s = time.perf_counter()
        plan_step_id = 0
        if not output.is_empty:
            for plan in self.translator.plans_for(output):
                if self.send_features:
                    plan = dataclasses.replace(plan, sequences=tuple(
                        dataclasses.replace(seq, send_features=True) for seq in plan.sequences))
                reply = self.execute(plan)
                if isinstance(reply, ErrorReply):
                    self.scheduler.update(output, {})
                    raise EngineStepError(f"attention worker refused step {plan.step_id}: "
                                          f"{reply.code.value}: {reply.message}")
                if not isinstance(reply, StepResult):
                    self.scheduler.update(output, {})
                    raise EngineStepError(f"attention worker answered {type(reply).__name__} to a step plan")
                result = translate_result(plan, reply)
                plan_step_id = plan.step_id
            ended_s = time.perf_counter()
        events = self.scheduler.update(output, result.sequence_results)
        for event in events:
            self._record(event, result.logprobs.get(event.request_id))
        answers = result.sequence_results.values()
        return StepRecord(
            step_id=plan_step_id, num_tokens=output.num_scheduled_tokens, num_sequences=len(output.scheduled),
            is_decode=is_decode(output),
            began_s=began_s, ended_s=ended_s, num_drafts=output.num_draft_tokens,
            num_accepted=sum(answer.num_accepted_drafts for answer in answers),
            num_tokens_gained=sum(len(answer.sampled_token_ids) for answer in answers), events=tuple(events))

    def run(self, before_step: Callable[[], None] | None = None,
            on_step: Callable[[StepRecord], None] | None = None) -> dict[str, RequestOutput]:
        """Step until every request finished; the outputs by request id."""
        while not self.done:
            if before_step is not None:
                before_step()
            record = self.step()
            if on_step is not None:
                on_step(record)
            if self._idle and not self.done:
                raise EngineStepError(f"{self.scheduler.num_unfinished_requests} requests cannot be scheduled")
        self.release_slots()
        return self.outputs

    def release_slots(self) -> None:
        """Once every request finished: one plan that frees the worker's slots they still hold."""
        if self.done and self.translator.num_slots_held:
            self.step()

    def _record(self, event: RequestEvent, logprobs: TokenLogprobs | None) -> None:
        output = self.outputs[event.request_id]
        output.output_token_ids.extend(event.new_token_ids)
        if logprobs is not None:
            output.logprobs.extend(_token_logprobs(logprobs, index) for index in range(len(event.new_token_ids)))
        output.num_draft_tokens += event.num_draft_tokens
        output.num_accepted_drafts += event.num_accepted_drafts
        if event.finish_reason is not None:
            output.finish_reason = event.finish_reason.value
            output.error = event.error


def is_decode(output: SchedulerOutput) -> bool:
    """Every scheduled sequence is past its prompt (an empty step counts as decode)."""
    return all(seq.start_position >= seq.num_prompt_tokens for seq in output.scheduled)


def _token_logprobs(logprobs: TokenLogprobs, index: int) -> TokenLogprobs:
    """Entry `index` of a step's TokenLogprobs (one entry per token it gained) as its own TokenLogprobs."""
    return TokenLogprobs(logprobs=(logprobs.logprobs[index],),
                         top_token_ids=(logprobs.top_token_ids[index],) if logprobs.top_token_ids else (),
                         top_logprobs=(logprobs.top_logprobs[index],) if logprobs.top_logprobs else ())


class RemoteAttention:
    """A StepExecutor over ZeroMQ: each plan to the attention worker at `endpoint`, its reply back."""

    def __init__(self, endpoint: str, step_timeout_s: float) -> None:
        import zmq

        from moemesh.common.wire.transport import SyncClient

        self._context = zmq.Context()
        self._client = SyncClient(endpoint, context=self._context, default_timeout_s=step_timeout_s)

    def __call__(self, plan: StepPlan):
        return self._client.request(plan)

    def close(self) -> None:
        self._client.close()
        self._context.term()
