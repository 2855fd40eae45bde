"""Greedy speculation equals plain decoding for many concurrent requests and every width policy.

The serving loop of tests/spec_inprocess.py (the router's Scheduler, PlanTranslator and
DraftCoordinator, the real attention worker with an expert worker process, every message through
the wire codec) on the tiny random model (sliding window 8, CSA ratio 4, HCA ratio 8: a decode of
20 tokens crosses a compressor boundary every few tokens), 10 requests at once. The drafts come
from an oracle that knows the plain greedy continuation and breaks it at a position that varies
with the request and the step, so verify steps accept all, some or none of their drafts, with
per-request confidences that vary too. Widths: fixed 1 and 4 (the router keeps the drafter's
block), and the router's cost-aware policy over a fixed cost model (it cuts some blocks, keeps
others). Every request's output must equal the single-process reference token for token.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import DraftProposal, DraftRequest, DraftTokens
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.services.router.engine_drafts import DraftConfig, DraftCoordinator
from moemesh.services.router.scheduler import SchedulerConfig
from moemesh.services.router.spec_cost import FixedStepCost
from moemesh.services.router.spec_policy import CostPolicyConfig, WidthPolicyKind
from spec_inprocess import SpecLoop, attention_beside_one_expert_worker, tiny_drafter_checkpoint

pytestmark = pytest.mark.timeout(300)

NUM_REQUESTS = 10  # all in one batch
MAX_TOKENS = 20
BLOCK = 4
NUM_BLOCKS = 64


def _prompts() -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(11)
    return [tuple(torch.randint(2, 250, (5 + 2 * index,), generator=generator).tolist())
            for index in range(NUM_REQUESTS)]


class OracleDrafter:
    """Proposes the reference continuation, wrong from slot `(index + seed position) % (n + 2)` on
    (no wrong slot when that is >= n). Confidences vary by request and slot."""

    def __init__(self, full_sequences: dict[str, list[int]]) -> None:
        self.full = full_sequences
        self.index = {request_id: index for index, request_id in enumerate(full_sequences)}
        self.num_proposed = 0

    def add_features(self, message) -> None:  # the attention worker's TargetFeatures: not needed here
        pass

    async def handle(self, request: DraftRequest) -> DraftTokens:
        proposals = []
        for slot in request.slots:
            seed_position = slot.start_position + len(slot.last_token_ids) - 1
            index = self.index[slot.request_id]
            tokens = list(self.full[slot.request_id][seed_position + 1:seed_position + 1 + slot.num_draft_tokens])
            wrong_from = (index + seed_position) % (len(tokens) + 2)
            for k in range(wrong_from, len(tokens)):
                tokens[k] = (tokens[k] + 1 + k) % 256
            confidences = tuple(0.95 - 0.2 * ((index + k) % 4) for k in range(len(tokens)))
            proposals.append(DraftProposal(slot.request_id, tuple(tokens), (1.0,) * len(tokens), confidences))
            self.num_proposed += len(tokens)
        return DraftTokens(step_id=request.step_id, proposals=tuple(proposals))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(loaded attention worker, {request_id: prompt}, {request_id: reference output})."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("spec_greedy_ckpt")
    prompts = {f"r{index}": prompt for index, prompt in enumerate(_prompts())}
    config, expected = tiny_drafter_checkpoint(path, BLOCK, 23, prompts, MAX_TOKENS)
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("spec_greedy_run")),
                       num_expert_workers=1, placement="all", with_attention=False)
    with LocalCluster(spec) as cluster:
        attention = attention_beside_one_expert_worker(cluster, path, config, "attention-greedy", NUM_BLOCKS)
        yield attention, prompts, expected, str(path)
        asyncio.run(attention.close())
    torch.set_num_threads(previous_threads)


CASES = {
    "fixed_width_1": (1, WidthPolicyKind.DRAFTER, None),
    "fixed_width_4": (4, WidthPolicyKind.DRAFTER, None),
    # verification costs 2 ms per token on a 10 ms step, drafter 3 ms: low-confidence blocks are cut
    "adaptive_cost_aware": (4, WidthPolicyKind.COST, FixedStepCost(base_s=0.010, per_token_s=0.002, draft_s=0.003)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_speculation_equals_plain_decoding_for_concurrent_requests(stack, case):
    attention, prompts, expected, _ = stack
    width, policy, cost = CASES[case]
    oracle = OracleDrafter({rid: list(prompt) + expected[rid] for rid, prompt in prompts.items()})
    loop = SpecLoop(attention, oracle, SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=256,
                                                       block_size_tokens=128), max_draft_tokens=width)
    loop.drafts = DraftCoordinator(DraftConfig(max_draft_tokens=width, timeout_s=600.0, width_policy=policy),
                                   loop._propose, cost=cost)
    for request_id, prompt in prompts.items():
        loop.add(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    loop.run()
    assert loop.outputs() == expected
    stats = loop.drafts.stats()
    drafted, accepted = stats["spec_draft_by_position"], stats["spec_accepted_by_position"]
    assert 0 < sum(accepted) < sum(drafted), (drafted, accepted)  # some drafts accepted, some rejected
    if policy is WidthPolicyKind.COST:
        assert 0 < stats["spec_policy_num_cut_drafts"] < stats["spec_policy_num_proposed_drafts"], stats
    else:  # plain decoding of the batch takes MAX_TOKENS steps (prefill included)
        assert loop.num_steps < MAX_TOKENS


def test_plain_runs_leave_gaps_in_the_drafters_rings_and_change_nothing(stack):
    """The real draft worker behind the cost policy when drafting never pays (a 200 ms drafter): the
    router skips it, probes now and then, and asks for target features only just before a probe, so
    the drafter's rings have gaps. Proposals still come, and the outputs are the plain ones."""
    from moemesh.common.speculation_width import SpeculationConfig, SpeculationMode
    from moemesh.common.drafting.proposer import DrafterConfig
    from moemesh.services.draft.worker import DraftWorker

    attention, prompts, expected, path = stack
    draft_worker = DraftWorker(DrafterConfig(checkpoint_path=path,
                                                 speculation=SpeculationConfig(SpeculationMode.ADAPTIVE, width=BLOCK)))
    asyncio.run(draft_worker.load())
    loop = SpecLoop(attention, draft_worker, SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=256),
                    max_draft_tokens=BLOCK)
    policy = CostPolicyConfig(probe_every_steps=2, max_probe_every_steps=8, feature_warmup_steps=1,
                              min_calibration_drafts=0)
    config = DraftConfig(max_draft_tokens=BLOCK, timeout_s=600.0, width_policy=WidthPolicyKind.COST, cost_policy=policy)
    loop.drafts = DraftCoordinator(config, loop._propose,
                                   cost=FixedStepCost(base_s=0.010, per_token_s=0.001, draft_s=0.200))
    for request_id, prompt in prompts.items():
        loop.add(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    loop.run()
    assert loop.outputs() == expected
    stats = loop.drafts.stats()
    assert stats["spec_policy_num_probe_steps"] >= 2 and stats["spec_policy_num_steps_without_features"] > 0, stats
    assert stats["spec_num_draft_requests"] >= 3 and sum(stats["spec_draft_by_position"]) > 0, stats
