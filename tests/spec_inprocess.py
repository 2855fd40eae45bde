"""The serving loop with speculation, in one process, for distribution tests (no HTTP).

`SpecLoop` runs the router's engine steps 2-7 over real objects: the router's `Scheduler`,
`PlanTranslator` and `DraftCoordinator`, an in-process `AttentionWorker` (its routed experts in
an expert worker process), and a `DraftWorker`. Only the two sockets that touch the drafter are
replaced by direct calls, and every message still goes through the wire codec both ways
(encode, decode), as it would on the socket:
- router -> drafter: `DraftCoordinator`'s propose function calls `DraftWorker.handle`;
- attention worker -> drafter: `InProcessFeatureLink` takes the place of `FeatureSender`.
Without a DraftWorker (draft_worker None) the attention worker drafts in its own process (its
config's `drafter`, `[draft] placement = "attention"`): drafts come back in the StepResult.
So the drafts, their sparse distributions, the scheduler's draft accounting, the worker's causal
verification and rollback, and the features the drafter conditions on are the serving ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire import codec
from moemesh.services.attention.speculation import attach_feature_sender
from moemesh.services.router.engine_drafts import DraftConfig, DraftCoordinator
from moemesh.services.router.engine_plan import PlanTranslator, translate_result
from moemesh.services.router.scheduler import Request, Scheduler, SchedulerConfig


def wire_round_trip(message):
    """The message as the receiver sees it: encoded to frames and decoded, validated."""
    return codec.decode([bytes(frame) for frame in codec.encode(message)])


class InProcessFeatureLink:
    """The attention worker's feature sender, delivering to an in-process DraftWorker."""

    def __init__(self, draft_worker) -> None:
        self.draft_worker = draft_worker
        self.num_sent = 0

    def send(self, message) -> bool:
        self.draft_worker.add_features(wire_round_trip(message))
        self.num_sent += 1
        return True

    def close(self) -> None:
        pass


@dataclass
class SpecLoop:
    """scheduler_config must match the attention worker's KV pool (num_gpu_blocks blocks)."""

    attention: object  # AttentionWorker, loaded
    draft_worker: object  # DraftWorker, loaded; None: the attention worker drafts itself (its config's drafter)
    scheduler_config: SchedulerConfig
    max_draft_tokens: int
    requests: dict[str, Request] = field(default_factory=dict)
    first_drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each request's first proposal
    num_steps: int = 0

    def __post_init__(self) -> None:
        self.scheduler = Scheduler(self.scheduler_config)
        self.translator = PlanTranslator()
        self.drafts = DraftCoordinator(DraftConfig(max_draft_tokens=self.max_draft_tokens, timeout_s=600.0,
                                                   in_attention=self.draft_worker is None), self._propose)
        if self.draft_worker is not None:
            attach_feature_sender(self.attention, InProcessFeatureLink(self.draft_worker))

    async def _propose(self, request):
        reply = wire_round_trip(await self.draft_worker.handle(wire_round_trip(request)))
        for proposal in getattr(reply, "proposals", ()):
            if proposal.token_ids:
                self.first_drafts.setdefault(proposal.request_id, proposal.token_ids)
        return reply

    def add(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        request = Request(request_id=request_id, prompt_token_ids=tuple(prompt), sampling_params=params)
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    def run(self) -> None:
        """Until every added request finished (raises on a failed request)."""
        asyncio.run(self._run())

    async def _run(self) -> None:
        while self.scheduler.num_unfinished_requests:
            output = self.scheduler.schedule()
            results, next_drafts, draft_s = {}, {}, 0.0
            for plan in self.translator.plans_for(output):
                plan = self.drafts.decorate(plan, self.scheduler)
                reply = wire_round_trip(self.attention.step(wire_round_trip(plan)))
                translated = translate_result(plan, reply)
                results.update(translated.sequence_results)
                next_drafts.update(translated.next_drafts)
                draft_s += translated.draft_s
            for request_id, proposal in next_drafts.items():
                self.first_drafts.setdefault(request_id, proposal.token_ids)
            events = self.scheduler.update(output, results)
            self.num_steps += 1
            for event in events:
                if event.error is not None:
                    raise RuntimeError(f"{event.request_id} failed: {event.error}")
            self.drafts.record(events)
            await self.drafts.after_step(self.scheduler, events, next_drafts, draft_s)

    def outputs(self) -> dict[str, list[int]]:
        return {request_id: list(request.output_token_ids) for request_id, request in self.requests.items()}


def attention_beside_one_expert_worker(cluster, path, config, name: str, num_blocks: int, **extra):
    """A loaded AttentionWorker on the CPU whose routed experts are all in the cluster's one expert worker
    process (extra: more AttentionWorkerConfig fields, e.g. drafter)."""
    from moemesh.common.placement.worker_holdings import WorkerHoldings
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig

    pairs = tuple((layer, expert) for layer in range(config.num_hidden_layers) for expert in range(config.n_routed_experts))
    expert = cluster.expert_names[0]
    attention = AttentionWorker(AttentionWorkerConfig(
        name=name, checkpoint_path=str(path), expert_endpoints=(cluster.endpoint_of(expert),),
        expert_workers=(WorkerHoldings(expert, pairs),), dispatch_timeout_s=60.0,
        kv=KVPoolConfig(num_primary_blocks=num_blocks), **extra))
    attention.load_now()
    return attention


def tiny_drafter_checkpoint(path, block_size: int, seed: int, prompts: dict, max_tokens: int):
    """A tiny checkpoint with a DSpark drafter (3 stages fed by target layers 1-3) written to `path`, and the
    plain greedy outputs of `prompts` ({request_id: token ids}) from the single-process reference:
    (config, {request_id: output token ids})."""
    from moemesh.commands.generate import _load_model
    from moemesh.common.checkpoint.writer import write_checkpoint
    from moemesh.common.model.generate import GenerationConfig, generate_batch
    from tiny_checkpoint_support import random_hub_state_dict, tiny_config

    config = tiny_config(num_nextn_predict_layers=3, dspark_block_size=block_size, dspark_markov_rank=32,
                         dspark_target_layer_ids=[1, 2, 3], dspark_noise_token_id=255)  # the worker captures features
    write_checkpoint(path, config, random_hub_state_dict(config, seed=seed))
    reference, _ = _load_model(str(path), "float32", "cpu")
    outputs = generate_batch(reference, list(prompts.values()), GenerationConfig(max_new_tokens=max_tokens))
    return config, dict(zip(prompts, outputs))
