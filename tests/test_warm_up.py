"""The router's start-time warm-up (services/router/warm_up.py, warm_up_plan.py, engine_warm_up.py).

- the plan: decode waves whose steps hold every graph bucket, context stages one per power of two of CSA
  rows (each just past it), step sizes of every power of two, nothing past the context cap or the pool;
- the engine over a recording attention peer (real scheduler, real sockets, no torch): /health is 503
  ("warming up") until the warm-up ends, its decode steps reach every bucket at every context stage, its
  steps get the warm-up's step timeout, the attention worker is told once (EndWarmUp) after its last step,
  and afterwards nothing of it remains (fresh scheduler: no prefix keys, counters, steps) and a request
  answers as without it;
- the attention worker's side: routing counts dropped, graph statistics reported;
- `moemesh serve` on the CPU (slow): `--warm-up on` runs it through the real workers before the URL is
  printed, answers at temperature 0 equal those of `--warm-up off` (which logs no warm-up), no request,
  token or prefix-cache counter moved, and the routing summary counts the user's steps only.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import zmq.asyncio

from moemesh.common.runtime.deployment import DeploymentError, parse_deployment
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import (
    EndWarmUp, ErrorCode, ErrorReply, Ping, Pong, SequenceResult, StepPlan, StepResult, WarmUpEnded,
)
from moemesh.common.wire.transport import AsyncServer
from moemesh.services.router.engine import Engine
from moemesh.services.router.engine_client import GenerationRequest
from moemesh.services.router.engine_config import EngineConfig
from moemesh.services.router.scheduler import SchedulerConfig
from moemesh.services.router.warm_up import EngineWarmUpConfig, WarmUp, prompt_token_ids
from moemesh.services.router.warm_up_plan import (
    GRAPH_BUCKETS, SyntheticRequest, WarmUpShape, batch_sizes, context_waves, decode_waves, plan_waves, staggered,
    step_token_waves,
)
from engine_peer_support import run_engine_against_peer

SHAPE = WarmUpShape(max_num_running_seqs=8, max_num_batched_tokens=256, long_prefill_token_threshold=64,
                    block_size_tokens=128, num_gpu_blocks=64, max_context_tokens=700, csa_compress_ratio=4,
                    index_topk=16)


# ------------------------------------------------------------------ the plan
def _decode_sizes(requests: tuple[SyntheticRequest, ...], num_steps: int) -> list[int]:
    """Sequences in decode step d = 1..num_steps of requests admitted together (the first token comes with
    the prefill, each decode step adds one)."""
    return [sum(1 for request in requests if request.max_tokens > step) for step in range(1, num_steps + 1)]


def test_decode_waves_hold_every_bucket_once():
    assert batch_sizes(64) == GRAPH_BUCKETS[::-1]
    assert batch_sizes(48) == (48, 32, 16, 8, 4, 2, 1)  # 48 sequences reach the 64 bucket
    assert batch_sizes(256) == GRAPH_BUCKETS[::-1]  # above 64 steps run eagerly: nothing to capture
    requests = staggered(batch_sizes(64), 8, 0.0)
    assert len(requests) == 64 and _decode_sizes(requests, 8) == [64, 32, 16, 8, 4, 2, 1, 0]
    greedy, sampled = decode_waves(SHAPE)
    assert _decode_sizes(greedy.requests, 5) == [8, 4, 2, 1, 0]
    assert {r.temperature for r in greedy.requests} == {0.0} and {r.temperature for r in sampled.requests} == {1.0}


def test_context_stages_reach_each_power_of_two_of_csa_rows_within_the_cap():
    waves = context_waves(SHAPE)
    lengths = [wave.requests[0].num_prompt_tokens for wave in waves]
    assert lengths == [68, 132, 260, 516]  # (rows + 1) x ratio for rows 16, 32, 64, 128; 1028 > 700
    for wave in waves:
        lead = wave.requests[0]
        assert lead.shared_prefix and lead.num_prompt_tokens + lead.max_tokens <= SHAPE.max_context_tokens
        # beside the lead, followers decode 7, 3, 1, then none: buckets 8, 4, 2, 1 at this context
        assert [1 + n for n in _decode_sizes(wave.followers, 4)] == [8, 4, 2, 1]
        assert lead.max_tokens > max(r.max_tokens for r in wave.followers) + 2  # outlives them, a step late
    assert context_waves(WarmUpShape(**{**vars(SHAPE), "index_topk": None})) == []  # no CSA layers
    small_pool = WarmUpShape(**{**vars(SHAPE), "num_gpu_blocks": 9})
    assert [w.requests[0].num_prompt_tokens for w in context_waves(small_pool)] == [68, 132]


def test_step_token_waves_cover_each_power_of_two_and_a_full_budget():
    sizes = [sum(r.num_prompt_tokens for r in wave.requests) for wave in step_token_waves(SHAPE)]
    assert sizes == [16, 32, 64, 256]  # one step each (prompts of one chunk), then 4 chunks at once
    names = [wave.name for wave in plan_waves(SHAPE)]
    assert names[:4] == ["step_tokens_16", "step_tokens_32", "step_tokens_64", "step_tokens_256"]
    assert names[4:7] == ["decode_buckets_t0", "decode_buckets_t1", "long_prefill"]


def test_synthetic_prompts_share_only_the_context_prefix():
    filler = tuple(range(100, 140))
    short, long = (prompt_token_ids(SyntheticRequest(n, 2, shared_prefix=True), seed, filler)
                   for n, seed in ((68, 5), (132, 9)))
    assert long[:68] == short  # stage k + 1 restores stage k's blocks (a prefix hit inside the warm-up)
    one, other = (prompt_token_ids(SyntheticRequest(256, 1), seed, filler) for seed in (1, 2))
    assert one[:16] != other[:16] and set(one) <= set(filler)


def test_deployment_warm_up_table():
    def base():  # overrides change the raw table in place
        return {"model": {"path": "m"}, "attention": [{"name": "attention-0", "device": "cuda:0"}],
                "expert": [{"name": "expert-0"}]}

    deployment = parse_deployment(base())
    assert deployment.warm_up.mode == "auto" and deployment.warm_up.enabled_for("cuda:0")
    assert not deployment.warm_up.enabled_for("cpu")
    off = parse_deployment(base(), ["warm_up.mode=off", "warm_up.step_timeout_s=900"])
    assert not off.warm_up.enabled_for("cuda:0") and off.warm_up.step_timeout_s == 900.0
    with pytest.raises(DeploymentError, match="warm_up.mode"):
        parse_deployment(base(), ["warm_up.mode=sometimes"])
    with pytest.raises(DeploymentError, match="warm_up.max_context_tokens"):
        parse_deployment(base(), ["warm_up.max_context_tokens=-1"])


# ------------------------------------------------------------------ the engine over a recording peer
def toy_next_token(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97 + 3


class RecordingPeer:
    """An attention worker in miniature: per-slot histories (restores rebuilt from the plan's prior
    tokens), every plan kept, EndWarmUp answered; `delay_s` slows the first plan down."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context) -> None:
        self.server = AsyncServer(endpoint, context=context, accept=(StepPlan, Ping, EndWarmUp))
        self.slots: dict[int, tuple[str, list[int]]] = {}
        self.plans: list[StepPlan] = []
        self.end_warm_up_after: list[int] = []  # len(plans) when each EndWarmUp came
        self.delay_s = 0.0

    async def run(self) -> None:
        while True:
            incoming = await self.server.recv()
            match incoming.message:
                case Ping(nonce=nonce):
                    reply = Pong(nonce=nonce, name="peer")
                case EndWarmUp():
                    self.end_warm_up_after.append(len(self.plans))
                    reply = WarmUpEnded(num_graph_captures=3)
                case StepPlan() as plan:
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                        self.delay_s = 0.0
                    try:
                        reply = self.execute(plan)
                    except AssertionError as error:
                        reply = ErrorReply(code=ErrorCode.INTERNAL, message=str(error))
            await self.server.reply(incoming, reply)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        restored = {restore.request_id: restore.num_tokens for restore in plan.prefix_restores}
        results = []
        for seq in plan.sequences:
            if seq.sampling is not None:
                assert len(seq.prior_token_ids) == seq.start_position == restored.get(seq.request_id, 0)
                self.slots[seq.seq_slot] = (seq.request_id, list(seq.prior_token_ids))
            owner, history = self.slots[seq.seq_slot]
            assert owner == seq.request_id and seq.start_position == len(history), seq.request_id
            history.extend(seq.token_ids)
            if seq.do_sample:
                results.append(SequenceResult(seq.request_id, (toy_next_token(history),)))
        for slot in plan.free_seq_slots:
            self.slots.pop(slot, None)
        return StepResult(step_id=plan.step_id, sequences=tuple(results))


def _run_with_peer(tmp_path, scenario, warm_up: WarmUp | None):
    # graph-sized short prefills on, as with a CUDA attention worker: the warm-up still runs whole chunks
    scheduler = SchedulerConfig(num_gpu_blocks=SHAPE.num_gpu_blocks, max_model_len=1024,
                                max_num_running_seqs=SHAPE.max_num_running_seqs,
                                max_num_batched_tokens=SHAPE.max_num_batched_tokens,
                                long_prefill_token_threshold=SHAPE.long_prefill_token_threshold,
                                graph_chunk_tokens=8, graph_step_tokens=64, graph_prefill_token_threshold=64)

    def engine_config(endpoint: str) -> EngineConfig:
        return EngineConfig(attention_endpoint=endpoint, step_timeout_s=0.3, recovery_poll_s=0.02)

    return run_engine_against_peer(tmp_path, RecordingPeer, engine_config, scheduler, scenario, timeout_s=60,
                                   warm_up=warm_up)


async def _generate(engine: Engine, request_id: str, prompt: tuple[int, ...], max_tokens: int):
    request = GenerationRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [event async for event in await engine.submit(request)]


def _expected(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(toy_next_token(tokens))
    return tokens[len(prompt):]


def test_engine_warm_up_reaches_every_bucket_then_leaves_nothing(tmp_path):
    filler = tuple(range(10, 60))
    warm_up = WarmUp(EngineWarmUpConfig(SHAPE, step_timeout_s=5.0, filler_token_ids=filler))
    num_warm_plans = [0]

    async def scenario(engine: Engine, peer: RecordingPeer):
        peer.delay_s = 1.0  # past the engine's 0.3 s step timeout, within the warm-up's 5 s
        health = engine.health()
        assert not health.ok and health.services["router"].startswith(("warming up", "starting"))
        while not warm_up.finished:
            assert not engine.health().ok
            await asyncio.sleep(0.01)
        assert engine.health().ok and warm_up.num_waves_done == len(warm_up.waves)
        assert peer.end_warm_up_after == [len(peer.plans)]  # once, after the warm-up's last plan
        num_warm_plans[0] = len(peer.plans)
        stats = engine.scheduler.stats()
        assert engine.scheduler.config.graph_chunk_tokens == 8  # the serving config after the warm-up
        assert stats.counters.num_steps == 0 and stats.prefix_cache_queried_tokens == 0
        assert stats.num_gpu_blocks_cached == 0 and stats.num_gpu_blocks_used == 0
        assert engine.stats()["num_steps"] == 0 and engine.num_failed_steps == 0
        # a prompt equal to a warm-up context prompt restores nothing and answers as the model does
        prompt = prompt_token_ids(SyntheticRequest(260, 1, shared_prefix=True), 0, filler)
        events = await _generate(engine, "user-1", prompt, 4)
        assert [t for e in events for t in e.new_token_ids] == _expected(prompt, 4)
        assert events[-1].usage.num_cached_prompt_tokens == 0
        short = tuple(range(200, 220))  # after the warm-up a short prompt goes in graph-sized chunks
        events = await _generate(engine, "user-2", short, 2)
        assert [t for e in events for t in e.new_token_ids] == _expected(short, 2)
        return peer.plans

    plans = _run_with_peer(tmp_path, scenario, warm_up)
    warm_plans = plans[:num_warm_plans[0]]
    chunks = [len(seq.token_ids) for plan in plans for seq in plan.sequences if seq.request_id == "user-2"]
    assert chunks == [8, 8, 4, 1]
    decode_sizes: dict[str, set[int]] = {}
    for plan in warm_plans:
        if plan.sequences and all(len(seq.token_ids) == 1 for seq in plan.sequences):
            for seq in plan.sequences:
                wave = re.sub(r"-\d+$", "", seq.request_id)
                decode_sizes.setdefault(wave, set()).add(len(plan.sequences))
    buckets = set(batch_sizes(SHAPE.max_num_running_seqs))
    for name in ("decode_buckets_t0", "decode_buckets_t1", "context_68", "context_132", "context_260",
                 "context_516"):
        assert buckets <= decode_sizes[f"warm-up-{name}"], name
    step_tokens = {sum(len(seq.token_ids) for seq in plan.sequences) for plan in warm_plans}
    assert {16, 32, 64, 256} <= step_tokens  # whole short prompts, not graph-sized chunks
    assert any(plan.prefix_restores for plan in warm_plans)  # the context stages restore one another


def test_engine_without_warm_up_is_ready_at_once(tmp_path):
    async def scenario(engine: Engine, peer: RecordingPeer):
        assert engine.health().ok
        events = await _generate(engine, "user-1", (5, 6, 7), 3)
        assert [t for e in events for t in e.new_token_ids] == _expected((5, 6, 7), 3)
        assert peer.end_warm_up_after == []

    _run_with_peer(tmp_path, scenario, None)


# ------------------------------------------------------------------ the attention worker's side
def test_end_warm_up_drops_routing_counts_and_reports_graphs():
    import torch

    from moemesh.services.attention.graph_decode import GraphStats
    from moemesh.services.attention.routing_stats import RoutingCounter
    from moemesh.services.attention.warm_up_end import end_warm_up

    class Worker:
        routing = RoutingCounter(2, 4, 2, torch.device("cpu"))
        runner = type("Runner", (), {"graphs": type("Graphs", (), {"stats": GraphStats(5, 1, 7, 4)})()})()

    worker = Worker()
    worker.routing.add(0, torch.tensor([[0, 1], [2, 3]]), torch.tensor([False, True]))
    worker.routing.step_done()
    ended = end_warm_up(worker)
    assert (ended.num_graph_captures, ended.num_graph_steps, ended.num_eager_steps) == (4, 5, 7)
    assert int(worker.routing.counts.sum()) == 0 and worker.routing.num_steps == 0
    worker.runner.graphs = None
    assert end_warm_up(worker) == WarmUpEnded()


def test_drafts_forget_their_measurements():
    from moemesh.services.router.engine_drafts import DraftConfig, DraftCoordinator
    from moemesh.services.router.spec_policy import WidthPolicyKind

    async def propose(request):
        raise AssertionError("not asked")

    drafts = DraftCoordinator(DraftConfig(width_policy=WidthPolicyKind.COST), propose)
    drafts.draft_by_position[0] = drafts.accepted_by_position[0] = drafts.num_draft_requests = 3
    drafts.widths.observe_draft(4, 0.01)
    old_widths = drafts.widths
    drafts.forget_measurements()
    stats = drafts.stats()
    assert stats["spec_draft_by_position"][0] == stats["spec_accepted_by_position"][0] == 0
    assert stats["spec_num_draft_requests"] == 0 and drafts.widths is not old_widths


# ------------------------------------------------------------------ moemesh serve on the CPU
def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
              or line.startswith(name + "{")]
    return sum(values)


def _events(run_dir, prefix: str) -> list[dict]:
    path = run_dir / "logs" / "router.log"
    return [event for event in (json.loads(line) for line in path.read_text().splitlines() if line.startswith("{"))
            if event["event"].startswith(prefix)]


PROMPTS = ("In the beginning God", "Recite John 3:16.")


def _answers(base_url: str) -> list[str]:
    return [httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": "kjv-dsv4-mini", "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
            for prompt in PROMPTS]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_warm_up_on_the_cpu_leaves_answers_and_counters_as_without_it(tmp_path):
    from spec_support import DEFAULT_MODEL, start_serve

    if not any(DEFAULT_MODEL.glob("*.safetensors")):
        pytest.skip("default model weights missing")
    warm = start_serve(tmp_path / "warm", "--warm-up", "on", "--warm-up-context-tokens", "600",
                       "--speculation", "off")
    try:
        assert "moemesh serving" in warm.first_line, warm.logs()
        started, = _events(warm.run_dir, "router.warm_up_started")
        finished, = _events(warm.run_dir, "router.warm_up_finished")
        assert finished["completed"] and finished["num_steps"] > 20 and finished["seconds"] > 0
        assert started["max_context_tokens"] == 600
        metrics = httpx.get(f"{warm.base_url}/metrics", timeout=30).text
        for name in ("moemesh_requests_total", "moemesh_prompt_tokens_total", "moemesh_generation_tokens_total",
                     "moemesh_prefix_cache_queried_tokens", "moemesh_cached_prompt_tokens_total"):
            assert _metric(metrics, name) == 0, name
        status = httpx.get(f"{warm.base_url}/status.json", timeout=30).json()
        assert status["engine"]["num_steps"] == 0 and status["engine"]["prefix_cache_hit_tokens"] == 0
        warm_answers = _answers(warm.base_url)
        # the attention worker's routing summary comes every 32 steps it counts: the first after the warm-up
        # covers 12 + 12 steps of the two answers and 8 of this request, none of the warm-up's 45
        prompt_ids = list(range(200, 240))
        reply = httpx.post(f"{warm.base_url}/v1/completions", timeout=120, json={
            "model": "kjv-dsv4-mini", "prompt": prompt_ids, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        summary_steps = _metric(httpx.get(f"{warm.base_url}/metrics", timeout=30).text,
                                "moemesh_routing_summary_steps")
        assert summary_steps == 32
    finally:
        assert warm.stop() == 0, warm.logs()
    cold = start_serve(tmp_path / "cold", "--warm-up", "off", "--speculation", "off")
    try:
        assert "moemesh serving" in cold.first_line, cold.logs()
        assert _events(cold.run_dir, "router.warm_up") == []
        assert _answers(cold.base_url) == warm_answers
    finally:
        assert cold.stop() == 0, cold.logs()
