"""The router's engine loop (docs/design.md §2, steps 2 and 6) and the `EngineClient` it offers.

    while True:
        await wait_for_work()                      # new requests, aborts, running sequences
        drain_inbox()                              # requests in, aborts applied
        if not await attention_reachable(): continue
        output = scheduler.schedule()              # step 2
        result = await execute(output)             # StepPlan -> attention worker -> StepResult
        publish(scheduler.update(output, result))  # step 6: token events to the streams at once
        await drafts.after_step(...)               # step 7: next draft block per request (engine_drafts.py)

Everything else is a named helper. The loop is one asyncio task in the router's event loop
(the same loop uvicorn serves HTTP on), so the scheduler is only ever touched between
awaits and needs no lock: the HTTP handlers only append to the inbox and read counters.

Failure model (a failed step, a restarted attention worker, requests waiting for recovery):
engine_recovery.py. The start-time warm-up (warm_up.py) is a task beside the loop that submits synthetic
requests to it before `health()` may be ok, then forgets them (engine_warm_up.py). Imports no torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import structlog
import zmq.asyncio

from moemesh.common.wire.errors import ReplyTimeout, WireError
from moemesh.common.wire.messages import ErrorReply, StepResult
from moemesh.common.wire.transport import AsyncClient
from moemesh.common.runtime.supervisor import Supervisor
from moemesh.common.security.socket_security import SocketSecurity
from moemesh.services.router.engine_client import (
    EngineError,
    FinishReason,
    GenerationRequest,
    HealthReport,
    Rejection,
)
from moemesh.services.router.engine_config import EngineConfig
from moemesh.services.router.engine_drafts import DraftCoordinator
from moemesh.services.router.engine_health import HealthTracker
from moemesh.services.router.engine_plan import PlanTranslator, ResultMismatch, TranslatedResult, failed_results, translate_result
from moemesh.services.router.engine_recovery import EngineRecovery
from moemesh.services.router.engine_warm_up import EngineWarmUp, warm_up_scheduler
from moemesh.services.router.engine_streams import RequestStream
from moemesh.services.router.guided_decoding import attach_token_masks
from moemesh.services.router.scheduler import Request, RequestEvent, Scheduler, SchedulerOutput
from moemesh.services.router.step_totals import DecodeStepTotals
from moemesh.services.router.warm_up import WarmUp

log = structlog.get_logger("router")


class StepFailed(Exception):
    """The attention worker did not execute a plan (refusal, wrong reply, timeout)."""


class WorkerRestarted(StepFailed):
    """A new attention worker process announced itself while a plan was in flight."""


class Engine(EngineRecovery, EngineWarmUp):
    def __init__(self, config: EngineConfig, scheduler: Scheduler, *, supervisor: Supervisor | None = None,
                 context: zmq.asyncio.Context | None = None, security: SocketSecurity | None = None,
                 drafts: DraftCoordinator | None = None, warm_up: WarmUp | None = None) -> None:
        """security: how the client socket to the attention worker is secured (CURVE client), None: plain.
        drafts: speculative decoding (engine_drafts.py); None: no drafter.
        warm_up: the start-time warm-up (warm_up.py), run once the workers are ready; None: none."""
        self.config = config
        self.drafts = drafts
        self.warm_up = warm_up
        self._warm_up_task: asyncio.Task | None = None
        self._security = security
        self.scheduler = scheduler
        self.serving_scheduler_config = scheduler.config  # what the scheduler runs with after the warm-up
        if warm_up is not None:
            self.scheduler = warm_up_scheduler(scheduler)
        self.health_tracker = HealthTracker(config, supervisor)
        self.translator = PlanTranslator(self._client_request_id)
        self._context = context
        self._owns_context = context is None
        self._client: AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self._streams: dict[str, RequestStream] = {}
        self._new_requests: list[Request] = []
        self._aborted_ids: list[str] = []
        self._wake = asyncio.Event()
        self._last_probe_s = 0.0
        self.num_steps = 0
        self.num_failed_steps = 0
        # wall time in attention steps (send plan .. StepResult) less the worker's drafting, for benchmarks
        self.step_seconds_total = 0.0
        self.decode_step_totals = DecodeStepTotals()  # the attention worker's counters over decode steps
        self.routing_summary = None  # the attention worker's latest RoutingSummary (for /metrics skew gauges)
        self._attention_pid: int | None = None  # the attention worker process the KV bookkeeping describes

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to the attention worker and start the loop task (call inside the event loop)."""
        if self._context is None:
            self._context = zmq.asyncio.Context()
        self._client = self._attention_client()
        self._task = asyncio.create_task(self._run_guarded(), name="engine-loop")
        if self.warm_up is not None:
            self._warm_up_task = asyncio.create_task(self.warm_up.run(self), name="warm-up")
        log.info("router.engine_started", attention=self.config.attention_endpoint, warm_up=self.warm_up is not None)

    async def stop(self, reason: str = "router shutting down") -> None:
        """Stop the loop, end every open stream with an ERROR event, close the socket."""
        self.health_tracker.stopping = True
        if self._warm_up_task is not None:
            self._warm_up_task.cancel()
            await asyncio.gather(self._warm_up_task, return_exceptions=True)
            self._warm_up_task = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fail_all_streams(reason)
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._owns_context and self._context is not None:
            self._context.term()
            self._context = None
        log.info("router.engine_stopped", reason=reason)

    # -- EngineClient ------------------------------------------------------------------
    async def submit(self, request: GenerationRequest) -> AsyncIterator:
        report = self.health()
        if not report.ok:
            await self._await_recovery(request.request_id, report)
        return self._open_stream(request)

    def _open_stream(self, request: GenerationRequest) -> AsyncIterator:
        if request.request_id in self._streams:
            raise EngineError(f"duplicate request id {request.request_id!r}")
        max_model_len = self.scheduler.config.max_model_len
        if len(request.prompt_token_ids) >= max_model_len:
            raise EngineError(f"prompt of {len(request.prompt_token_ids)} tokens leaves no room under "
                              f"max_model_len={max_model_len}")
        now_s = time.monotonic()
        deadline_s = None
        if request.deadline_unix_s is not None:
            deadline_s = now_s + (request.deadline_unix_s - time.time())
        scheduled = Request(
            request_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            arrival_time_s=now_s,
            deadline_s=deadline_s,
            eos_token_ids=self.config.eos_token_ids,
            guide=request.guide,
        )
        # the HTTP request's id, bound by services/router/request_id.py in the task calling submit
        stream = RequestStream(scheduled, structlog.contextvars.get_contextvars().get("request_id"))
        self._streams[request.request_id] = stream
        self._new_requests.append(scheduled)
        self._wake.set()
        return stream.events()

    def _client_request_id(self, sequence_id: str) -> str | None:
        stream = self._streams.get(sequence_id)
        return stream.client_request_id if stream is not None else None

    async def abort(self, request_id: str) -> None:
        """End the stream now (ABORT); the scheduler frees its blocks at the next loop turn."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return
        stream.push(stream.final_event(FinishReason.ABORT))
        self._aborted_ids.append(request_id)
        self._wake.set()

    def health(self) -> HealthReport:
        report = self.health_tracker.report()
        if self.drafts is not None:  # a detail only: serving goes on without the drafter
            report = HealthReport(ok=report.ok, services={**report.services, "draft": self.drafts.status()})
        if self.warm_up is not None and not self.warm_up.finished:
            report = HealthReport(ok=False, services={**report.services, "router": self.warm_up.status()})
        if self._task is None or self._task.done():
            return HealthReport(ok=False, services={**report.services, "router": "down: engine loop not running"})
        return report

    def admission_check(self, estimated_prompt_tokens: int) -> Rejection | None:
        decision = self.scheduler.check_admission(estimated_prompt_tokens)
        if decision.admitted:
            return None
        reason = decision.reject_reason.value if decision.reject_reason is not None else "overloaded"
        return Rejection(reason=reason, retry_after_s=float(decision.retry_after_seconds or 1))

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        return {
            "num_waiting": stats.num_waiting_requests + len(self._new_requests),
            "num_running": stats.num_running_seqs,
            "kv_blocks_used": {"gpu": stats.num_gpu_blocks_used, "cpu": stats.num_cpu_blocks_used},
            "kv_blocks_total": {"gpu": stats.num_gpu_blocks_total, "cpu": stats.num_cpu_blocks_total},
            "kv_snapshots_used": {"gpu": stats.num_gpu_snapshots_used, "cpu": stats.num_cpu_snapshots_used},
            "kv_snapshots_cached": {"gpu": stats.num_gpu_snapshots_cached},
            "kv_snapshots_total": {"gpu": stats.num_gpu_snapshots_total, "cpu": stats.num_cpu_snapshots_total},
            "kv_block_size_tokens": self.scheduler.config.block_size_tokens,
            "max_model_len": self.scheduler.config.max_model_len,
            "prefix_cache_queried_tokens": stats.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
            "preemptions": {"swap": stats.counters.num_preemptions_swap,
                            "recompute": stats.counters.num_preemptions_recompute},
            "num_steps": self.num_steps,
            "step_seconds_total": self.step_seconds_total,
            "decode_step_counters": self.decode_step_totals.to_json(),
            **(self.drafts.stats() if self.drafts is not None else {}),
            **({"routing_summary": self.routing_summary} if self.routing_summary is not None else {}),
        }

    # -- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        """The engine loop; runs until cancelled."""
        idle = False
        while True:
            await self._wait_for_work(idle)
            self._drain_inbox()
            self._check_attention_restart()
            if not await self._attention_reachable():
                self._expire_carried()
                continue
            output = self.scheduler.schedule()
            idle = output.is_empty
            if idle:
                self._publish(self.scheduler.update(output, {}), TranslatedResult({}, {}))
                continue
            result = await self._execute(output)
            if result.failure is not None:
                # the step's outcome is unknown: its events are not published; each open request is
                # carried over or ends with the cause (_carry_or_fail)
                self.scheduler.update(output, result.sequence_results)
                self._carry_or_fail(f"attention worker failed: {result.failure}", carry=result.worker_lost)
                await self._reconnect()
                continue
            events = self.scheduler.update(output, result.sequence_results)
            self._publish(events, result)
            if self.drafts is not None:  # step 7: the next block per request, before schedule()
                self.drafts.record(events)
                await self.drafts.after_step(self.scheduler, events, result.next_drafts, result.draft_s)

    async def _run_guarded(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in the loop must not leave requests hanging
            log.exception("router.engine_loop_crashed")
            self._fail_all_streams("internal error: the engine loop crashed")
            raise

    async def _wait_for_work(self, idle: bool) -> None:
        """Return at once while anything is queued (or running, unless the last schedule()
        found nothing to do); otherwise sleep until woken or idle_wait_s passed, so that
        deadlines of queued requests still expire."""
        if self._new_requests or self._aborted_ids:
            return
        if not idle and self.scheduler.num_unfinished_requests:
            return
        try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for can lose a cancellation
            async with asyncio.timeout(self.config.idle_wait_s):
                await self._wake.wait()
        except TimeoutError:
            pass
        self._wake.clear()

    def _drain_inbox(self) -> None:
        new_requests, self._new_requests = self._new_requests, []
        for request in new_requests:
            try:
                self.scheduler.add_request(request)
            except ValueError as error:
                stream = self._streams.pop(request.request_id, None)
                if stream is not None:
                    stream.push(stream.final_event(FinishReason.ERROR, str(error)))
        aborted_ids, self._aborted_ids = self._aborted_ids, []
        if aborted_ids:
            log.info("router.requests_aborted", num_aborted=len(aborted_ids), sequence_ids=aborted_ids[:32],
                     request_ids=self._client_ids(aborted_ids))
        for request_id in aborted_ids:
            self.scheduler.abort(request_id)  # None when it finished meanwhile: harmless
            self._streams.pop(request_id, None)

    async def _execute(self, output: SchedulerOutput) -> TranslatedResult:
        """Send the step's plan(s) and translate the answer; on any failure, results that end
        every scheduled request with the reason."""
        result = TranslatedResult({}, {})
        self.health_tracker.record_step_started()
        started_s = time.perf_counter()
        step_counters = []  # the attention worker's, per plan
        try:
            for plan in self.translator.plans_for(output):
                if self.drafts is not None:
                    plan = self.drafts.decorate(plan, self.scheduler)
                plan = attach_token_masks(plan, self._guide_of)  # after the drafts: masks cover them
                reply = await self._request_step(plan)
                match reply:
                    case StepResult():
                        result = translate_result(plan, reply)
                        step_counters.append(reply.counters)
                        if reply.routing is not None:
                            self.routing_summary = reply.routing
                    case ErrorReply(code=code, message=message):
                        raise StepFailed(f"attention worker refused step {plan.step_id}: {code.value}: {message}")
                    case _:
                        raise StepFailed(f"attention worker answered {type(reply).TYPE} to a step_plan")
        except ReplyTimeout:
            return self._step_failed(output, f"attention worker did not answer within {self._step_timeout_s():.1f}s",
                                     worker_lost=True)
        except WorkerRestarted as error:
            return self._step_failed(output, str(error), worker_lost=True)
        except (StepFailed, ResultMismatch, WireError) as error:
            return self._step_failed(output, str(error))
        self.num_steps += 1
        step_s = time.perf_counter() - started_s
        self.step_seconds_total += step_s - result.draft_s  # drafting in the worker counts as drafting
        for counters in step_counters:
            self.decode_step_totals.add(counters, step_s / len(step_counters))
        if self.drafts is not None:  # the cost-aware width policy learns the step cost from it
            self.drafts.observe_step(output, step_s, result.draft_s)
        self.health_tracker.record_step_ok()
        log.debug("router.step", step_id=output.step_id, num_sequences=len(output.scheduled),
                  num_tokens=output.num_scheduled_tokens)
        return result

    def _guide_of(self, request_id: str):
        request = self.scheduler.get_request(request_id)
        return None if request is None else request.guide

    async def _request_step(self, plan):
        """The attention worker's reply to one plan. While it is awaited, and when it comes, a
        Ready from a new attention worker process (another pid: the old one died with the plan)
        fails the step (WorkerRestarted) instead of the step timeout; checked every 0.25 s, which
        delays no reply (asyncio.wait returns as soon as the reply is there)."""
        supervisor = self.health_tracker.supervisor
        if supervisor is None:
            return await self._client.request(plan, timeout_s=self._step_timeout_s())
        name = self.config.attention_name
        known_pid = supervisor.ready[name].pid if name in supervisor.ready else None
        reply = asyncio.ensure_future(self._client.request(plan, timeout_s=self._step_timeout_s()))
        try:
            while True:
                done, _ = await asyncio.wait({reply}, timeout=0.25)
                ready = supervisor.ready.get(name)
                # a reply with a new Ready is discarded too: ZeroMQ may have handed the plan, queued for
                # the dead process, to its successor, which knows nothing of the slots it names
                if ready is not None and ready.pid != known_pid:
                    raise WorkerRestarted(f"the attention worker restarted (pid {known_pid} -> {ready.pid}) "
                                          f"during step {plan.step_id}")
                if done:
                    return reply.result()
        finally:
            if not reply.done():
                reply.cancel()
                await asyncio.gather(reply, return_exceptions=True)

    def _step_failed(self, output: SchedulerOutput, message: str, worker_lost: bool = False) -> TranslatedResult:
        self.num_failed_steps += 1
        self.health_tracker.record_step_failure(message)
        log.warning("router.step_failed", attention=self.config.attention_name, step_id=output.step_id,
                    reason=message, worker_lost=worker_lost,
                    sequence_ids=[seq.request_id for seq in output.scheduled][:32],
                    request_ids=self._client_ids(seq.request_id for seq in output.scheduled))
        return TranslatedResult(dict(failed_results(output, message)), {}, failure=message, worker_lost=worker_lost)

    def _publish(self, events: list[RequestEvent], result: TranslatedResult) -> None:
        """Push each event to its stream at once; finished streams leave the table."""
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue  # aborted by the client: its stream already ended
            stream.push(stream.token_event(event, result.logprobs.get(event.request_id)))
            if event.is_finished:
                del self._streams[event.request_id]

    def _fail_all_streams(self, reason: str) -> None:
        for stream in self._streams.values():
            stream.push(stream.final_event(FinishReason.ERROR, reason))
        self._streams.clear()
