"""The router's start-time warm-up: synthetic requests through the engine's own loop before `/health` is 200.

    wait until every needed worker is ready (and the drafter is up or known down)
    -> for each wave of warm_up_plan.plan_waves: submit its requests (Engine.submit_warm_up: the scheduler,
       StepPlans, the attention and expert workers, the drafter, as for any request) and await their last
       events; a wave's followers go in once its lead request has its first token
    -> Engine.end_warm_up: once nothing runs, EndWarmUp to the attention worker (it drops the routing counts
       of the synthetic steps and reports the graphs it holds), then the engine forgets the warm-up
    -> /health turns 200 (the router's entry read "warming up: ..." meanwhile).

The steps are the engine's ordinary steps (chunked prefill, mixed steps, decode, prefix restores between
the context stages, drafts and verification with speculation on), so every first-use compile and graph
capture they reach happens here; their step timeout is `[warm_up] step_timeout_s` instead of
`timeouts.step_s`, because a first step at a new shape of a full-width model can take minutes.

What the synthetic requests leave behind: nothing a user reads. They never pass the gateway (no request
or token counters, no request log events, no X-Request-Id); the engine then starts a fresh scheduler of
the same config (no prefix-cache keys or hit counters, no scheduler counters, an empty throughput meter
for admission), zeroes its step counters, the decode step totals and the routing summary, and the drafts'
coordinator forgets its acceptance counters and the cost policy's measurements. The attention worker
forgets the routing counts (placement statistics). What stays: the compiled kernels and captured graphs
(the point), the Triton cache on disk, the attention worker's per-step phase log and graph statistics, the
KV blocks' stale bytes (free in the fresh scheduler, never restored), and the drafter's rings of the
finished synthetic requests until the next draft request frees them, as for any finished request.
A failed wave (an error event, a lost worker) ends the warm-up early with `router.warm_up_failed`;
the server then serves, paying what was not reached on first use.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.engine_client import EngineError, FinishReason, GenerationRequest
from moemesh.services.router.warm_up_plan import SyntheticRequest, WarmUpShape, WarmUpWave, plan_waves

log = structlog.get_logger("router")

REQUEST_ID_PREFIX = "warm-up-"
SHARED_PREFIX_SEED = 0  # the filler of the context stages' lead prompts (prefixes of one another)
SAMPLED_SEED = 1234  # temperature-1 requests are seeded: the warm-up does the same work on every start
READY_POLL_S = 0.1


@dataclass(frozen=True)
class EngineWarmUpConfig:
    """The router's warm-up, resolved from `[warm_up]` (common/runtime/deployment.py) in main():
    shape: what bounds the synthetic steps; step_timeout_s: the step timeout while it runs;
    filler_token_ids: the token ids synthetic prompts are drawn from (ordinary text of the tokenizer)."""

    shape: WarmUpShape
    step_timeout_s: float = 600.0
    filler_token_ids: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if not self.filler_token_ids:
            raise ValueError("filler_token_ids is empty")


def prompt_token_ids(request: SyntheticRequest, seed: int, filler_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """A synthetic prompt: pseudo-random filler tokens from `seed` (SHARED_PREFIX_SEED for shared-prefix
    requests: the prompts are then prefixes of one another; every other request has its own seed, so no two
    of them share a first block and none restores another's prefix)."""
    rng = random.Random(SHARED_PREFIX_SEED if request.shared_prefix else seed)
    return tuple(rng.choices(filler_token_ids, k=request.num_prompt_tokens))


class WarmUp:
    """Runs the waves against an engine (services/router/engine.py) and says how far it got (`status`)."""

    def __init__(self, config: EngineWarmUpConfig, waves: tuple[WarmUpWave, ...] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.waves = plan_waves(config.shape) if waves is None else waves
        self.clock = clock
        self.running = False  # the engine uses the warm-up's step timeout while set
        self.finished = False
        self.num_waves_done = 0
        self.wave_name = ""
        self._seeds = itertools.count(SHARED_PREFIX_SEED + 1)

    @property
    def step_timeout_s(self) -> float:
        return self.config.step_timeout_s

    def status(self) -> str:
        """The router's /health entry while the warm-up is not finished."""
        if not self.running:
            return "starting: the warm-up waits for the workers"
        return f"warming up: wave {self.num_waves_done + 1} of {len(self.waves)} ({self.wave_name})"

    def progress(self) -> dict:
        return {"finished": self.finished, "num_waves": len(self.waves), "num_waves_done": self.num_waves_done,
                "wave": self.wave_name}

    async def run(self, engine) -> None:
        """The whole warm-up; never raises but when cancelled (a failure is logged and the server serves
        without the rest)."""
        try:
            await self._wait_for_workers(engine)
            self.running = True
            started_s = self.clock()
            num_steps_before = engine.num_steps
            log.info("router.warm_up_started", num_waves=len(self.waves),
                     num_requests=sum(wave.num_requests for wave in self.waves),
                     max_context_tokens=self.config.shape.max_context_tokens, step_timeout_s=self.step_timeout_s)
            failure = await self._run_waves(engine)
            num_steps = engine.num_steps - num_steps_before
            ended = await engine.end_warm_up()
            log.info("router.warm_up_finished", seconds=round(self.clock() - started_s, 3), num_steps=num_steps,
                     num_waves_done=self.num_waves_done, num_waves=len(self.waves), completed=failure is None,
                     num_graph_captures=None if ended is None else ended.num_graph_captures,
                     num_graph_steps=None if ended is None else ended.num_graph_steps,
                     num_eager_steps=None if ended is None else ended.num_eager_steps)
        except asyncio.CancelledError:
            raise
        except Exception:  # the server must become ready all the same
            log.exception("router.warm_up_crashed", wave=self.wave_name)
        finally:
            self.running = False
            self.finished = True

    async def _run_waves(self, engine) -> str | None:
        """Every wave in order; the first failure's reason (the rest are left out), else None."""
        for wave in self.waves:
            self.wave_name = wave.name
            failure = await self._run_wave(engine, wave)
            if failure is not None:
                log.warning("router.warm_up_failed", wave=wave.name, reason=failure,
                            num_waves_done=self.num_waves_done)
                return failure
            self.num_waves_done += 1
        return None

    async def _wait_for_workers(self, engine) -> None:
        while not engine.workers_ready():
            await asyncio.sleep(READY_POLL_S)

    async def _run_wave(self, engine, wave: WarmUpWave) -> str | None:
        """Submit the wave and await every request's end; the reason of the first failure, else None."""
        wave_started_s = self.clock()
        lead_first_token = asyncio.Event()  # set by any event of the lead, its final one included
        pumps = [asyncio.ensure_future(self._submit(engine, wave, request, lead_first_token if index == 0 else None))
                 for index, request in enumerate(wave.requests)]
        if wave.followers:
            await lead_first_token.wait()
            pumps += [asyncio.ensure_future(self._submit(engine, wave, request, None)) for request in wave.followers]
        failures = [failure for failure in await asyncio.gather(*pumps) if failure is not None]
        log.info("router.warm_up_wave", wave=wave.name, num_requests=wave.num_requests,
                 seconds=round(self.clock() - wave_started_s, 3))
        return failures[0] if failures else None

    async def _submit(self, engine, wave: WarmUpWave, request: SyntheticRequest,
                      first_token: asyncio.Event | None) -> str | None:
        seed = next(self._seeds)
        params = SamplingParams(temperature=request.temperature, max_tokens=request.max_tokens, ignore_eos=True,
                                seed=SAMPLED_SEED + seed if request.temperature > 0 else None)
        generation = GenerationRequest(request_id=f"{REQUEST_ID_PREFIX}{wave.name}-{seed}",
                                       prompt_token_ids=prompt_token_ids(request, seed, self.config.filler_token_ids),
                                       sampling_params=params)
        try:
            return await self._pump(engine.submit_warm_up(generation), first_token)
        except EngineError as error:
            return str(error)
        finally:
            if first_token is not None:  # whatever happened, followers never wait for a lead that is gone
                first_token.set()

    @staticmethod
    async def _pump(events, first_token: asyncio.Event | None) -> str | None:
        async for event in events:
            if first_token is not None:
                first_token.set()
            if event.finished:
                if event.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    return event.error_message or event.finish_reason.value
                return None
        return "the stream ended without a final event"
