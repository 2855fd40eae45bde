"""The router's engine loop in miniature, over the simulated worker, for the scheduler tests.

`SimulatedEngine.step()` is the hot path's steps 2, 3-5 and 6 (schedule, execute, update)
with a pluggable drafter; it keeps every request object (also finished ones) and the events
streamed for each, so tests can compare outputs with what plain decoding would produce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moemesh.services.router.scheduler.output import RequestEvent, SchedulerOutput
from moemesh.services.router.scheduler.request import Request
from moemesh.services.router.scheduler.scheduler import Scheduler
from sim_worker_support import SimulatedWorker, fingerprints_of, next_fingerprint

# drafter(request, worker) -> draft token ids for the request's next step
Drafter = Callable[[Request, SimulatedWorker], list[int]]


@dataclass
class StepRecord:
    plan: SchedulerOutput
    events: list[RequestEvent]


@dataclass
class SimulatedEngine:
    scheduler: Scheduler
    drafter: Drafter | None = None
    check: bool = True
    vocab_size: int = 1000
    requests: dict[str, Request] = field(default_factory=dict)
    events: dict[str, list[RequestEvent]] = field(default_factory=dict)
    worker: SimulatedWorker = field(init=False)

    def __post_init__(self) -> None:
        self.worker = SimulatedWorker(
            self.scheduler.config, self._known_token_ids, vocab_size=self.vocab_size, check=self.check
        )

    def _known_token_ids(self, request_id: str) -> list[int]:
        request = self.requests[request_id]
        return list(request.prompt_token_ids) + request.output_token_ids

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request
        self.events[request.request_id] = []

    def step(self) -> StepRecord:
        if self.drafter is not None:
            for request in list(self.requests.values()):
                if not request.is_finished and request.output_token_ids:
                    self.scheduler.set_draft_tokens(request.request_id, self.drafter(request, self.worker))
        plan = self.scheduler.schedule()
        results = self.worker.execute(plan)
        events = self.scheduler.update(plan, results)
        for event in events:
            self.events[event.request_id].append(event)
        return StepRecord(plan, events)

    def run_until_done(self, max_steps: int, on_step: Callable[[StepRecord], None] | None = None) -> int:
        """Step until no request is left; returns the number of steps. Raises if max_steps pass
        first (a livelock or deadlock)."""
        for num_steps in range(1, max_steps + 1):
            record = self.step()
            if on_step is not None:
                on_step(record)
            if self.scheduler.num_unfinished_requests == 0:
                return num_steps
        raise RuntimeError(f"{self.scheduler.num_unfinished_requests} requests unfinished after {max_steps} steps")

    def expected_output(self, request: Request, num_tokens: int) -> list[int]:
        """What plain greedy decoding by the target model gives after the prompt."""
        fingerprint = fingerprints_of(request.prompt_token_ids)[-1]
        output = []
        for _ in range(num_tokens):
            output.append(self.worker.target_token(fingerprint))
            fingerprint = next_fingerprint(fingerprint, output[-1])
        return output


def oracle_drafter(num_drafts: int, num_wrong_at: int | None = None) -> Drafter:
    """Drafts that follow the target for num_drafts tokens; with num_wrong_at set, the draft
    at that index is deliberately wrong (so it and the rest are rejected)."""

    def propose(request: Request, worker: SimulatedWorker) -> list[int]:
        tokens = list(request.prompt_token_ids) + request.output_token_ids
        fingerprint = fingerprints_of(tokens)[-1]  # covers the last known token
        drafts = []
        for index in range(num_drafts):
            token = worker.target_token(fingerprint)
            if index == num_wrong_at:
                token = (token + 1) % worker.vocab_size
            drafts.append(token)
            fingerprint = next_fingerprint(fingerprint, token)
        return drafts

    return propose

