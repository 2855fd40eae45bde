"""The drafter in the attention worker's process (`[draft] placement = "attention"`).

- The serving loop of tests/spec_inprocess.py with the attention worker drafting itself (real DSpark
  stages of a tiny random checkpoint, every message through the wire codec): greedy outputs of
  concurrent requests equal the single-process reference, drafts are proposed and verified, and each
  proposal is drafted from the request's newest token at its true position.
- A sampled request drafts from its own seed and finishes.
- The router's side: the plan asks for drafts only from sequences that sample, the proposals come
  from the step's results (no DraftRequest), cut to what each request may still generate.
- The deployment: placement is validated, the in-attention drafter has no endpoint, key or process.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from moemesh.common.runtime.deployment import DeploymentError, derive_endpoints, parse_deployment
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.speculation_width import SpeculationConfig, SpeculationMode
from moemesh.common.wire.messages import DraftProposal
from moemesh.services.attention.local_drafter import seed_position_after
from moemesh.common.drafting.proposer import DrafterConfig
from moemesh.services.router.engine_drafts import DraftConfig, DraftCoordinator
from moemesh.services.router.engine_plan import PlanTranslator
from moemesh.services.router.scheduler import Request, Scheduler, SchedulerConfig
from spec_inprocess import SpecLoop, attention_beside_one_expert_worker, tiny_drafter_checkpoint

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
MAX_TOKENS = 16
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(attention worker drafting in its process, {request_id: prompt}, {request_id: reference output})."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("in_attention_ckpt")
    generator = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": tuple(torch.randint(2, 250, (6 + 3 * i,), generator=generator).tolist()) for i in range(4)}
    config, expected = tiny_drafter_checkpoint(path, BLOCK, 29, prompts, MAX_TOKENS)
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("in_attention_run")),
                       num_expert_workers=1, placement="all", with_attention=False)
    with LocalCluster(spec) as cluster:
        drafter = DrafterConfig(name="attention-0/draft", checkpoint_path=str(path),
                                speculation=SpeculationConfig(SpeculationMode.FIXED, width=BLOCK))
        attention = attention_beside_one_expert_worker(cluster, path, config, "attention-0", NUM_BLOCKS, drafter=drafter)
        yield attention, prompts, expected
        asyncio.run(attention.close())
    torch.set_num_threads(previous_threads)


def _recording_seeds(attention) -> list[tuple[str, int, int]]:
    """Wrap the in-process drafter's propose; returns the (request id, seed position, seed token) of
    every slot it was asked to draft, as the run goes."""
    worker = attention.local_drafter.proposer
    seeds: list[tuple[str, int, int]] = []
    original = worker.propose

    def propose(request):
        for slot in request.slots:
            seeds.append((slot.request_id, slot.start_position + len(slot.last_token_ids) - 1, slot.last_token_ids[-1]))
        return original(request)

    worker.propose = propose
    return seeds


def test_greedy_outputs_equal_the_reference_with_drafts_from_the_attention_worker(stack):
    attention, prompts, expected = stack
    loop = SpecLoop(attention, None, SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=256),
                    max_draft_tokens=BLOCK)
    seeds = _recording_seeds(attention)
    for request_id, prompt in prompts.items():
        loop.add(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    loop.run()
    assert loop.outputs() == expected
    stats = loop.drafts.stats()
    assert sum(stats["spec_draft_by_position"]) > 0 and stats["spec_num_draft_requests"] > 0, stats
    assert set(loop.first_drafts) == set(prompts)  # every request got drafts from the step's results
    assert {request_id for request_id, _, _ in seeds} == set(prompts)
    for request_id, position, token in seeds:  # drafted from the newest token, at its true position
        full = list(prompts[request_id]) + expected[request_id]
        assert full[position] == token, (request_id, position, token)


def test_a_sampled_request_drafts_from_its_seed_and_finishes(stack):
    attention, prompts, _ = stack
    loop = SpecLoop(attention, None, SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=256),
                    max_draft_tokens=BLOCK)
    prompt = next(iter(prompts.values()))
    loop.add("sampled", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7))
    loop.run()
    assert len(loop.outputs()["sampled"]) == MAX_TOKENS
    assert loop.drafts.stats()["spec_num_draft_requests"] > 0


def test_seed_position_after_a_verify_step():
    # 1 seed + 4 drafts from position 10, 2 accepted: positions 10..12 committed, the bonus token at 13
    assert seed_position_after(10, 5, 4, 2) == 13
    assert seed_position_after(0, 7, 0, 0) == 7  # a prompt of 7 tokens: the first sampled token at 7


async def _never_called(request):
    raise AssertionError("no DraftRequest with the drafter in the attention worker")


def test_router_asks_in_the_plan_and_takes_drafts_from_the_results():
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=64))
    scheduler.add_request(Request(request_id="g", prompt_token_ids=(5, 6, 7), sampling_params=SamplingParams(max_tokens=3)))
    scheduler.add_request(Request(request_id="s", prompt_token_ids=(5, 6), sampling_params=SamplingParams(
        max_tokens=20, temperature=0.8, seed=11)))
    drafts = DraftCoordinator(DraftConfig(max_draft_tokens=BLOCK, in_attention=True), _never_called)
    output = scheduler.schedule()
    plan = drafts.decorate(PlanTranslator().plans_for(output)[-1], scheduler)
    by_id = {seq.request_id: seq for seq in plan.sequences}
    assert by_id["g"].draft_after == BLOCK and by_id["g"].draft_seed is None
    assert by_id["s"].draft_after == BLOCK and by_id["s"].draft_seed == 11  # the request's own seed
    assert all(seq.send_features for seq in plan.sequences)
    from moemesh.services.router.scheduler import SequenceResult

    events = scheduler.update(output, {"g": SequenceResult(sampled_token_ids=(9,)),
                                       "s": SequenceResult(sampled_token_ids=(8,))})
    proposals = {"g": DraftProposal("g", (1, 2, 3, 4), (1.0,) * 4, (0.9,) * 4),
                 "s": DraftProposal("s", (1, 2, 3, 4), (0.5,) * 4, (0.9,) * 4,
                                    support_token_ids=((1,), (2,), (3,), (4,)), support_probs=((1.0,),) * 4)}
    asyncio.run(drafts.after_step(scheduler, events, proposals, 0.002))
    output = scheduler.schedule()
    scheduled = {seq.request_id: seq for seq in output.scheduled}
    assert list(scheduled["g"].draft_token_ids) == [1]  # max_tokens 3, one generated: one draft + the bonus
    assert list(scheduled["s"].draft_token_ids) == [1, 2, 3, 4]
    plan = drafts.decorate(PlanTranslator().plans_for(output)[-1], scheduler)
    sampled = next(seq for seq in plan.sequences if seq.request_id == "s")
    assert sampled.draft_support_probs == ((1.0,),) * 4  # the relayed distributions go with the drafts
    assert drafts.stats()["spec_num_draft_requests"] == 1


def _deployment(**draft) -> dict:
    return {"model": {"path": "/m"}, "attention": [{"name": "attention-0", "device": "cpu"}],
            "expert": [{"name": "expert-0", "device": "cpu"}], "draft": {"enabled": True, **draft}}


def test_the_deployment_places_the_drafter():
    process = parse_deployment(_deployment())
    assert process.draft.runs_process and derive_endpoints(process).draft is not None
    inside = parse_deployment(_deployment(placement="attention"))
    assert inside.draft.in_attention and not inside.draft.runs_process
    assert derive_endpoints(inside).draft is None
    with pytest.raises(DeploymentError, match="draft.placement"):
        parse_deployment(_deployment(placement="elsewhere"))


def test_the_draft_service_refuses_an_in_attention_deployment():
    from moemesh.services.draft.main import run

    with pytest.raises(DeploymentError, match="draft.placement"):
        run(dataclasses.replace(parse_deployment(_deployment(placement="attention"))))
