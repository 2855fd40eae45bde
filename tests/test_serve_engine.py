"""The router's engine loop over real ZeroMQ sockets, against a contract-checking peer.

The peer (`ContractPeer`) is not the attention worker: it is a strict executor of the
StepPlan contract over integers (per-slot token history, positions, slot ownership), whose
"model" is a fixed function of the tokens so far. It refuses any plan a correct worker could
not execute correctly (a slot reused while still owned, a position gap), so these tests fail
if the engine's translation or ordering is wrong. The real attention worker is exercised in
tests/test_e2e_serve.py.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import zmq.asyncio

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import (
    ErrorCode, ErrorReply, Ping, Pong, SequenceResult, StepPlan, StepResult, TokenLogprobs,
)
from moemesh.common.wire.transport import AsyncServer
from moemesh.services.router.engine import Engine
from moemesh.services.router.engine_client import EngineError, FinishReason, GenerationRequest
from moemesh.services.router.engine_config import EngineConfig
from moemesh.services.router.scheduler import SchedulerConfig
from engine_peer_support import run_engine_against_peer

VOCAB = 97
EOS = 3


def toy_next_token(tokens: list[int]) -> int:
    """The peer's 'model': a deterministic function of every token so far (never EOS)."""
    value = (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB
    return value if value != EOS else EOS + 1


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(toy_next_token(tokens))
    return tokens[len(prompt):]


class ContractError(Exception):
    pass


class ContractPeer:
    """Executes plans on per-slot token histories; answers Ping; can be told to go silent."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context) -> None:
        self.server = AsyncServer(endpoint, context=context, accept=(StepPlan, Ping))
        self.slots: dict[int, tuple[str, list[int]]] = {}
        self.silent = False
        self.num_plans = 0
        self.num_release_only_plans = 0
        self.max_slots_in_use = 0

    async def run(self) -> None:
        while True:
            incoming = await self.server.recv()
            if self.silent:
                continue
            match incoming.message:
                case Ping(nonce=nonce):
                    reply = Pong(nonce=nonce, name="peer")
                case StepPlan() as plan:
                    try:
                        reply = self.execute(plan)
                    except ContractError as error:
                        reply = ErrorReply(code=ErrorCode.INTERNAL, message=str(error))
            await self.server.reply(incoming, reply)

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_plans += 1
        if not plan.sequences:
            self.num_release_only_plans += 1
        results = []
        for seq in plan.sequences:
            owner = self.slots.get(seq.seq_slot)
            if seq.sampling is not None:  # a sequence (re)starting in this slot
                if owner is not None and owner[0] != seq.request_id:
                    raise ContractError(f"slot {seq.seq_slot} reused while {owner[0]} holds it")
                if seq.start_position != 0:
                    raise ContractError("no prefix restore in this peer")
                owner = (seq.request_id, [])
                self.slots[seq.seq_slot] = owner
            if owner is None or owner[0] != seq.request_id:
                raise ContractError(f"{seq.request_id} on slot {seq.seq_slot} owned by {owner and owner[0]}")
            history = owner[1]
            if seq.start_position != len(history):
                raise ContractError(f"{seq.request_id}: slot at {len(history)}, plan at {seq.start_position}")
            history.extend(seq.token_ids)
            if seq.do_sample:
                token = toy_next_token(history)
                results.append(SequenceResult(seq.request_id, (token,),
                                              logprobs=TokenLogprobs((-0.25,), ((token, 7),), ((-0.25, -2.0),))))
        self.max_slots_in_use = max(self.max_slots_in_use, len(self.slots))
        for slot in plan.free_seq_slots:
            self.slots.pop(slot, None)
        return StepResult(step_id=plan.step_id, sequences=tuple(results))


@pytest.fixture
def run_engine(tmp_path):
    """run_engine(scenario, **scheduler overrides): scenario(engine, peer) runs inside one loop."""

    def run(scenario, step_timeout_s: float = 5.0, recovery_timeout_s: float = 90.0, **overrides):
        config = dict(num_gpu_blocks=16, max_model_len=1024, max_num_running_seqs=2,
                      max_num_batched_tokens=64, long_prefill_token_threshold=24)
        config.update(overrides)

        def engine_config(endpoint: str) -> EngineConfig:
            return EngineConfig(attention_endpoint=endpoint, step_timeout_s=step_timeout_s, probe_interval_s=0.05,
                                probe_timeout_s=0.5, eos_token_ids=(EOS,), recovery_timeout_s=recovery_timeout_s,
                                recovery_poll_s=0.02)

        return run_engine_against_peer(tmp_path, ContractPeer, engine_config, SchedulerConfig(**config), scenario,
                                       timeout_s=30)

    return run


_ids = itertools.count()


async def collect(engine: Engine, prompt: list[int], **params):
    request = GenerationRequest(f"r{next(_ids)}", tuple(prompt), SamplingParams(**params))
    events = [event async for event in await engine.submit(request)]
    return events


def tokens_of(events) -> list[int]:
    return [t for event in events for t in event.new_token_ids]


def test_concurrent_requests_match_and_reuse_slots(run_engine):
    prompts = [[5 + i] * length for i, length in enumerate((1, 7, 30, 55, 3, 90))]

    async def scenario(engine, peer):
        results = await asyncio.gather(*(collect(engine, p, max_tokens=5 + i) for i, p in enumerate(prompts)))
        return results, peer.num_release_only_plans, peer.max_slots_in_use, engine.stats()

    results, num_release_only, max_slots, stats = run_engine(scenario)
    for index, (prompt, events) in enumerate(zip(prompts, results)):
        assert tokens_of(events) == expected_output(prompt, 5 + index)
        assert [e.finished for e in events].count(True) == 1 and events[-1].finish_reason is FinishReason.LENGTH
        assert events[-1].usage.num_prompt_tokens == len(prompt)
        assert events[-1].usage.num_completion_tokens == 5 + index
    assert max_slots <= 2  # six requests through two slots: slots were released and reused
    assert stats["kv_blocks_used"]["gpu"] == 0 and stats["num_running"] == 0


def test_logprobs_and_stop_token(run_engine):
    prompt = [11, 12, 13]
    free_run = expected_output(prompt, 6)
    stop_at = free_run[2]

    async def scenario(engine, peer):
        with_logprobs = await collect(engine, prompt, max_tokens=4, num_logprobs=1)
        stopped = await collect(engine, prompt, max_tokens=6, stop_token_ids=(stop_at,))
        return with_logprobs, stopped

    with_logprobs, stopped = run_engine(scenario)
    assert [lp for e in with_logprobs for lp in (e.logprobs or ())] == [-0.25] * 4
    first_top = next(e.top_logprobs for e in with_logprobs if e.new_token_ids)[0]
    assert [(alt.token_id, alt.logprob) for alt in first_top] == [(free_run[0], -0.25), (7, -2.0)]
    assert tokens_of(stopped) == free_run[: free_run.index(stop_at) + 1]
    assert stopped[-1].finish_reason is FinishReason.STOP


def test_abort_ends_stream_and_frees_blocks(run_engine):
    async def scenario(engine, peer):
        request = GenerationRequest("long", tuple([9] * 200), SamplingParams(max_tokens=500))
        stream = await engine.submit(request)
        first = await anext(stream)
        await engine.abort("long")
        rest = [event async for event in stream]
        await engine.abort("long")  # idempotent
        for _ in range(50):
            if engine.stats()["kv_blocks_used"]["gpu"] == 0:
                break
            await asyncio.sleep(0.02)
        after = await collect(engine, [4, 5], max_tokens=3)  # the engine still serves
        return first, rest, engine.stats(), after

    first, rest, stats, after = run_engine(scenario, num_gpu_blocks=16, max_num_batched_tokens=256,
                                           long_prefill_token_threshold=256)
    assert not first.finished
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert stats["kv_blocks_used"]["gpu"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert tokens_of(after) == expected_output([4, 5], 3)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def test_step_timeout_carries_requests_until_the_worker_answers(run_engine):
    """A step lost to a silent worker: its request (no token given out yet) runs again once the
    worker answers Pings; one submitted meanwhile waits in submit and completes too."""
    async def scenario(engine, peer):
        assert engine.health().ok
        peer.silent = True
        first = asyncio.create_task(collect(engine, [1, 2, 3], max_tokens=4))
        await _until(lambda: engine.num_failed_steps >= 1)
        health_down = engine.health()
        second = asyncio.create_task(collect(engine, [4, 5], max_tokens=3))  # waits for recovery
        await asyncio.sleep(0.3)
        assert not first.done() and not second.done()
        peer.silent = False
        return await first, await second, health_down

    first, second, health_down = run_engine(scenario, step_timeout_s=0.3)
    assert not health_down.ok and health_down.services["attention-0"].startswith("down")
    assert tokens_of(first) == expected_output([1, 2, 3], 4) and first[-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(second) == expected_output([4, 5], 3) and second[-1].finish_reason is FinishReason.LENGTH


def test_recovery_timeout_ends_waiting_requests_with_the_cause(run_engine):
    """A worker that stays silent: a carried request ends with an error naming the recovery timeout
    and the failure; a new submission waits the same bound and is refused with a Retry-After;
    serving resumes when the worker answers again."""
    async def scenario(engine, peer):
        peer.silent = True
        carried = await collect(engine, [1, 2, 3], max_tokens=4)
        with pytest.raises(EngineError) as refused:
            await engine.submit(GenerationRequest("refused", (1,), SamplingParams()))
        peer.silent = False
        after = await collect(engine, [1, 2, 3], max_tokens=4)
        return carried, refused.value, after

    carried, refused, after = run_engine(scenario, step_timeout_s=0.3, recovery_timeout_s=0.8)
    assert carried[-1].finish_reason is FinishReason.ERROR
    assert "recovery timeout" in carried[-1].error_message and "did not answer" in carried[-1].error_message
    assert "after waiting" in str(refused) and refused.retry_after_s > 0
    assert tokens_of(after) == expected_output([1, 2, 3], 4)


def test_a_stream_with_tokens_out_ends_with_the_cause(run_engine):
    """Tokens already given to the gateway cannot be taken back: such a request ends with an error
    naming the failure, the others carry on."""
    async def scenario(engine, peer):
        request = GenerationRequest("streamed", (1, 2), SamplingParams(max_tokens=40))
        events = []
        async for event in await engine.submit(request):
            events.append(event)
            if len(events) == 2:
                peer.silent = True
        peer.silent = False
        return events

    events = run_engine(scenario, step_timeout_s=0.3)
    assert tokens_of(events) == expected_output([1, 2], 40)[:len(tokens_of(events))] and tokens_of(events)
    assert events[-1].finish_reason is FinishReason.ERROR
    assert "attention worker failed" in events[-1].error_message and "did not answer" in events[-1].error_message


def test_refused_step_fails_only_with_a_clear_error(run_engine):
    async def scenario(engine, peer):
        peer.slots[0] = ("someone-else", [])  # the peer now refuses the next new sequence on slot 0
        return await collect(engine, [1, 2], max_tokens=2)

    events = run_engine(scenario)
    assert events[-1].finish_reason is FinishReason.ERROR
    assert "refused step" in events[-1].error_message and "someone-else" in events[-1].error_message


def test_plan_translation_of_restores_swaps_and_sampling():
    """Scheduler outputs with a prefix hit, swaps and slot reuse map onto the wire fields."""
    from moemesh.services.router.engine_plan import PlanTranslator
    from moemesh.services.router.scheduler import RestoreReason, ScheduledSequence, SchedulerOutput, StateRestore

    def output(step_id, scheduled, freed=(), preempted=(), restores=(), swap_out=(), swap_in=(), snapshot_out=()):
        return SchedulerOutput(step_id, tuple(scheduled), tuple(swap_out), tuple(swap_in), tuple(snapshot_out), (),
                               tuple(restores), tuple(preempted), tuple(freed),
                               sum(len(s.token_ids) for s in scheduled), 0, 0)

    def seq(request_id, slot, tokens, start, new):
        return ScheduledSequence(request_id, slot, tuple(tokens), start, (4, 5), True, (), new,
                                 SamplingParams(max_tokens=3, seed=7))

    translator = PlanTranslator()
    [first] = translator.plans_for(output(1, [seq("a", 0, [1, 2], 0, True), seq("b", 1, [3], 0, True)]))
    assert [s.sampling is not None for s in first.sequences] == [True, True]
    assert first.sequences[0].sampling == SamplingParams(max_tokens=3, seed=7).to_wire()
    assert first.sequences[0].block_ids == ((4, 5),) and first.free_seq_slots == ()
    # a finishes; c takes its slot 0 with a 128-token prefix hit; b is preempted with a swap-out
    restore = StateRestore("c", 0, (4,), 128, RestoreReason.PREFIX_HIT, 6)
    plans = translator.plans_for(output(2, [seq("c", 0, [9], 128, True)], freed=["a"], preempted=["b"],
                                        restores=[restore], swap_out=[(5, 0)], snapshot_out=[(2, 1)]))
    assert [p.sequences for p in plans[:1]] == [()] and plans[0].free_seq_slots == (0,)  # released first
    main = plans[1]
    assert main.step_id == plans[0].step_id + 1
    assert main.free_seq_slots == (1,) and main.swap_out == ((5, 0),) and main.snapshot_swap_out == ((2, 1),)
    assert [(r.request_id, r.seq_slot, r.block_ids, r.num_tokens, r.snapshot_id)
            for r in main.prefix_restores] == [("c", 0, (4,), 128, 6)]
    [later] = translator.plans_for(output(3, [seq("c", 0, [8], 129, False)]))
    assert later.sequences[0].sampling is None  # the worker keeps it per slot
