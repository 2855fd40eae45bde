"""The router engine's recovery bookkeeping: a failed step, a restarted attention worker, and the
requests that wait for it to answer again. `Engine` (engine.py) inherits it; its loop calls it.

A sequence the worker reports as failed (SequenceResult.error) ends alone.
A whole step that times out or is refused leaves the worker's state unknown (a dispatch may
have died mid-layer), and a new attention worker process (a restart) has none of it: the
requests that have given the gateway no token yet are carried over (they run again from
their prompt once the worker answers), the others end with a final ERROR event naming the
cause; blocks and slots are freed, health turns 503 until the attention worker answers a
Ping again, and the socket to it is opened afresh so nothing queued for a dead process
reaches its successor. A request that arrives while a worker is down waits in `submit` for
it, and a carried one in the loop, both bounded by `recovery_timeout_s`; past it, EngineError
(the gateway's 503 with Retry-After) or an ERROR event. A crash of the loop itself fails
every open stream, so no request ever hangs.

`EngineRecovery` keeps no state of its own: it works on the engine's (`config`, `scheduler`,
`translator`, `health_tracker`, `_streams`, `_new_requests`, `_client` and its `_context` /
`_security`, `_task`, `_last_probe_s`, `_attention_pid`, the step counters, `routing_summary`),
all set by `Engine.__init__`, and on its `health()` and `_client_request_id()`. Imports no torch.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from moemesh.common.wire.codec import TORCH_FREE_MESSAGES
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.messages import Ping, Pong
from moemesh.common.wire.transport import AsyncClient
from moemesh.services.router.engine_client import EngineError, FinishReason, HealthReport
from moemesh.services.router.engine_plan import PlanTranslator
from moemesh.services.router.scheduler import Request, Scheduler

log = structlog.get_logger("router")


def _fault_ids(client_of: dict[str, str | None], **groups: list[str]) -> dict[str, list[str]]:
    """For a fault event: per group (failed, carried), the sequence ids and the HTTP request ids."""
    fields = {}
    for name, sequence_ids in groups.items():
        fields[f"{name}_sequence_ids"] = sequence_ids[:32]
        fields[f"{name}_request_ids"] = list(dict.fromkeys(
            client_of[i] for i in sequence_ids if client_of.get(i) is not None))[:32]
    return fields


def _problems(report: HealthReport) -> str:
    return ", ".join(f"{name}: {status}" for name, status in report.services.items() if status != "ok")


class EngineRecovery:
    """Restart and recovery bookkeeping of `Engine` (see the module docstring)."""

    def _client_ids(self, sequence_ids) -> list[str]:
        """The HTTP request ids (X-Request-Id) of these sequences, each once, for fault events."""
        ids = (self._client_request_id(sequence_id) for sequence_id in sequence_ids)
        return list(dict.fromkeys(client_id for client_id in ids if client_id is not None))[:32]

    async def _await_recovery(self, request_id: str, report: HealthReport) -> None:
        """Wait until health is ok again (a worker restarting, the router starting), at most
        recovery_timeout_s; EngineError with a Retry-After past it, or at once when the
        engine cannot recover (shutting down, loop stopped)."""
        started_s = time.monotonic()
        retry_after_s = self.config.unavailable_retry_after_s
        log.info("router.request_awaits_recovery", sequence_id=request_id, problems=_problems(report),
                 recovery_timeout_s=self.config.recovery_timeout_s)
        while not report.ok:
            if self.health_tracker.stopping or self._task is None or self._task.done():
                raise EngineError(f"not serving: {_problems(report)}", retry_after_s=retry_after_s)
            if time.monotonic() - started_s >= self.config.recovery_timeout_s:
                log.warning("router.recovery_timed_out", sequence_id=request_id, problems=_problems(report),
                            recovery_timeout_s=self.config.recovery_timeout_s)
                raise EngineError(f"not serving after waiting {self.config.recovery_timeout_s:.0f} s for "
                                  f"recovery: {_problems(report)}", retry_after_s=retry_after_s)
            await asyncio.sleep(self.config.recovery_poll_s)
            report = self.health()
        log.info("router.request_recovered", sequence_id=request_id,
                 waited_s=round(time.monotonic() - started_s, 3))

    def _check_attention_restart(self) -> None:
        """A new attention worker process (its Ready names another pid) starts with an empty KV
        pool and no slots, so what the scheduler knows (block tables, the prefix cache) describes
        memory that no longer exists: a prefix hit would restore garbage. The KV bookkeeping
        starts afresh (the prefix-cache counters with it); requests that have given the gateway
        no token yet carry over and run again from their prompt, the others end with an error
        naming the restart (_carry_or_fail)."""
        supervisor = self.health_tracker.supervisor
        ready = supervisor.ready.get(self.config.attention_name) if supervisor is not None else None
        if ready is None or ready.pid == self._attention_pid:
            return
        old_pid, self._attention_pid = self._attention_pid, ready.pid
        if old_pid is None and self.num_steps == 0 and self.num_failed_steps == 0:
            return  # the worker this router starts with (a Ready comes once per process, at its start;
            # a restarted router knows running workers by heartbeats only, so a Ready after its
            # first steps is a new process)
        client_of = {request_id: stream.client_request_id for request_id, stream in self._streams.items()}
        carried_ids, failed_ids = self._carry_or_fail(
            f"the attention worker {self.config.attention_name} restarted (pid {old_pid} -> {ready.pid})",
            log_event=None)
        log.warning("router.attention_restarted", attention=self.config.attention_name, old_pid=old_pid,
                    new_pid=ready.pid, num_failed_requests=len(failed_ids), num_carried_requests=len(carried_ids),
                    **_fault_ids(client_of, failed=failed_ids, carried=carried_ids))
        self.scheduler = Scheduler(self.scheduler.config, self.scheduler.clock)
        self.translator = PlanTranslator(self._client_request_id)
        self.routing_summary = None

    def _carry_or_fail(self, reason: str, log_event: str | None = "router.requests_recovering",
                       carry: bool = True) -> tuple[list[str], list[str]]:
        """After a failed step or an attention restart: every open request leaves the scheduler
        (blocks and slots freed). With `carry` (the worker was lost: a timeout, a restart), one
        that has given the gateway no token yet, within its recovery deadline (set by the first
        failure that catches it), is queued again as a fresh request: the client sees nothing of
        it but the wait. The others end with an ERROR event naming `reason` (all of them after a
        refused plan, which running again would not cure). Requests still in the inbox stay
        there. Returns (carried, failed) ids."""
        now_s = time.monotonic()
        client_of = {request_id: stream.client_request_id for request_id, stream in self._streams.items()}
        in_inbox = {request.request_id for request in self._new_requests}
        carried: list[Request] = []
        failed_ids: list[str] = []
        for request_id, stream in list(self._streams.items()):
            if request_id in in_inbox:
                continue
            self.scheduler.abort(request_id)  # None when the failed step already ended it
            if stream.recovery_deadline_s is None:
                stream.recovery_deadline_s = now_s + self.config.recovery_timeout_s
            if carry and stream.num_tokens_pushed == 0 and now_s < stream.recovery_deadline_s:
                old = stream.request
                stream.request = Request(request_id=old.request_id, prompt_token_ids=old.prompt_token_ids,
                                         sampling_params=old.sampling_params, arrival_time_s=old.arrival_time_s,
                                         deadline_s=old.deadline_s, eos_token_ids=old.eos_token_ids,
                                         guide=old.guide)
                carried.append(stream.request)
            else:
                stream.push(stream.final_event(FinishReason.ERROR, reason))
                del self._streams[request_id]
                failed_ids.append(request_id)
        self._new_requests = [*carried, *self._new_requests]
        carried_ids = [request.request_id for request in carried]
        if log_event is not None and (carried_ids or failed_ids):
            log.warning(log_event, attention=self.config.attention_name, reason=reason,
                        recovery_timeout_s=self.config.recovery_timeout_s,
                        **_fault_ids(client_of, failed=failed_ids, carried=carried_ids))
        return carried_ids, failed_ids

    def _expire_carried(self) -> None:
        """While the attention worker does not answer: carried requests past their recovery
        deadline end with an ERROR event naming why (health's view of the worker)."""
        now_s = time.monotonic()
        expired = [request_id for request_id, stream in self._streams.items()
                   if stream.recovery_deadline_s is not None and now_s >= stream.recovery_deadline_s]
        if not expired:
            return
        reason = (f"no attention worker within the recovery timeout of {self.config.recovery_timeout_s:.0f} s: "
                  f"{self.health_tracker.step_failure or 'not answering'}")
        expired_set = set(expired)
        self._new_requests = [r for r in self._new_requests if r.request_id not in expired_set]
        log.warning("router.recovery_timed_out", attention=self.config.attention_name, reason=reason,
                    sequence_ids=expired[:32], request_ids=self._client_ids(expired))
        for request_id in expired:
            self.scheduler.abort(request_id)
            stream = self._streams.pop(request_id)
            stream.push(stream.final_event(FinishReason.ERROR, reason))

    def _attention_client(self) -> AsyncClient:
        return AsyncClient(self.config.attention_endpoint, context=self._context, accept=TORCH_FREE_MESSAGES,
                           default_timeout_s=self.config.step_timeout_s, security=self._security)

    async def _reconnect(self) -> None:
        """A fresh socket to the attention worker: what the old one still queues for a dead
        process (a plan, Pings) is dropped instead of reaching its successor, and late replies
        to the old socket are never read."""
        old, self._client = self._client, self._attention_client()
        if old is not None:
            await old.close()

    async def _attention_reachable(self) -> bool:
        """True unless a step failed; then Ping (at most every probe_interval_s) until a Pong."""
        if self.health_tracker.step_failure is None:
            return True
        wait_s = self._last_probe_s + self.config.probe_interval_s - time.monotonic()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self._last_probe_s = time.monotonic()
        try:
            reply = await self._client.request(Ping(nonce=self.num_steps), timeout_s=self.config.probe_timeout_s)
        except ReplyTimeout:
            await self._reconnect()  # no Pings pile up for a worker that is not there yet
            return False
        if isinstance(reply, Pong):
            log.info("router.attention_recovered", attention=self.config.attention_name)
            self.health_tracker.record_step_ok()
            return True
        return False
