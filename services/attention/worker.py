"""The attention worker: executes StepPlans (architecture §2 steps 3 and 5).

`step(plan) -> StepResult` is the one visible loop:

    move KV blocks (swap_out, swap_in)          kv_pool.KVPool.move
    position each sequence in its slot          slots.SlotTable.prepare
    split the sequences into micro-batches      split_micro_batches
    run the layers, dispatching routed experts  model_runner.ModelRunner.forward
    logits of the sequences that sample         AttentionSide.logits
    sample (+ logprobs)                         sampling.Sampler
    release finished slots                      slots.SlotTable.free

It holds everything of the model except the routed experts, which it reaches through
`MoEDispatcher` (one Dispatch per expert worker per MoE layer and micro-batch). Stop tokens
and max_tokens are the router's business: the worker returns the token it sampled.
Legend: B sequences that sample, V vocab, K top logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from common.runtime.service import Service
from common.wire.messages import (
    ErrorCode, ErrorReply, ScheduledSequence, SequenceResult, StepPlan, StepResult, TokenLogprobs,
)
from services.attention.kv_config import KVPoolConfig
from services.expert.placement import WorkerHoldings, owner_table

log = structlog.get_logger("attention")


@dataclass(frozen=True)
class AttentionWorkerConfig:
    """expert_workers / expert_endpoints: the deployment's expert workers, same order. dtype: "auto" (float32 on CPU,
    bfloat16 elsewhere) or a torch dtype name."""

    name: str
    checkpoint_path: str
    expert_endpoints: tuple[str, ...]
    expert_workers: tuple[WorkerHoldings, ...]
    device: str = "cpu"
    dtype: str = "auto"
    num_micro_batches: int = 1
    placement_invariant: bool = False
    kv: KVPoolConfig = field(default_factory=KVPoolConfig)
    dispatch_timeout_s: float = 30.0


def split_micro_batches(num_sequences: int, num_micro_batches: int) -> list[range]:
    """Contiguous groups of sequence indices, as even as possible, none empty."""
    count = max(1, min(num_micro_batches, num_sequences))
    return [range(i * num_sequences // count, (i + 1) * num_sequences // count) for i in range(count)]


@dataclass
class _Work:
    scheduled: ScheduledSequence
    slot: Any  # slots.Slot


class AttentionWorker(Service):
    accepts = (StepPlan,)

    def __init__(self, config: AttentionWorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)

    async def load(self) -> None:
        self.load_now()

    def load_now(self) -> None:
        import zmq

        from common.checkpoint.reader import CheckpointReader
        from common.model.attention_side import AttentionSide
        from common.model.config import NumericsConfig
        from services.attention.expert_channel import ExpertChannel
        from services.attention.kv_pool import KVPool
        from services.attention.model_runner import ModelRunner
        from services.attention.moe_dispatch import MoEDispatcher
        from services.attention.sampling import Sampler
        from services.attention.slots import SlotTable
        from services.expert.worker import resolve_dtype

        dtype = resolve_dtype(self.config.dtype, self.config.device)
        reader = CheckpointReader(self.config.checkpoint_path)
        model_config = reader.config
        numerics = NumericsConfig(dtype=str(dtype).removeprefix("torch."))
        self.side = AttentionSide.from_state_dict(model_config, reader.load_attention_side(model_config, dtype),
                                                  numerics, device=self.device)
        self.pool = KVPool(model_config, self.config.kv, self.side.dtype, self.device)
        self.slots = SlotTable(model_config, self.pool, self.side.dtype, self.device)
        self._zmq_context = zmq.Context()
        self.channel = ExpertChannel(self.config.expert_endpoints, context=self._zmq_context,
                                     timeout_s=self.config.dispatch_timeout_s)
        owner = owner_table(self.config.expert_workers, model_config.num_hidden_layers, model_config.n_routed_experts)
        self.dispatcher = MoEDispatcher(self.channel, owner, placement_invariant=self.config.placement_invariant,
                                        device=self.device)
        self.runner = ModelRunner(self.side, self.dispatcher)
        self.sampler = Sampler()
        log.info("attention.loaded", name=self.config.name, device=str(self.device), dtype=str(dtype),
                 num_expert_workers=len(self.config.expert_endpoints), num_micro_batches=self.config.num_micro_batches,
                 placement_invariant=self.config.placement_invariant, kv_bytes_per_block=self.pool.num_bytes_per_block())

    async def handle(self, message: Any) -> Any:
        match message:
            case StepPlan():
                return self.step(message)
        return ErrorReply(code=ErrorCode.UNEXPECTED, message=f"{type(message).TYPE} not handled")

    async def close(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
            self._zmq_context.term()

    # ------------------------------------------------------------------ the loop
    def step(self, plan: StepPlan) -> StepResult:
        return self.run_step(plan)[0]

    @torch.inference_mode()
    def run_step(self, plan: StepPlan) -> tuple[StepResult, torch.Tensor | None]:
        """The StepResult and the logits [B, V] of the sequences that sampled (plan order)."""
        self.pool.move(plan.swap_out, plan.swap_in)
        work, errors = self._prepare(plan)
        groups = split_micro_batches(len(work), self.config.num_micro_batches)
        micro_batches = [self._micro_batch_inputs([work[i] for i in group]) for group in groups]
        finals = self.runner.forward(plan.step_id, micro_batches) if work else []
        logits = self._sampling_logits(work, groups, finals)
        results = self._sample(work, logits)
        self.slots.free(plan.free_seq_slots)
        log.debug("attention.step_done", step_id=plan.step_id, num_sequences=len(work),
                  num_micro_batches=len(groups), num_overlapped_runs=self.runner.stats.num_overlapped_runs)
        by_id = {**results, **errors}
        return StepResult(step_id=plan.step_id, sequences=tuple(by_id[s.request_id] for s in plan.sequences)), logits

    # ------------------------------------------------------------------ helpers
    def _prepare(self, plan: StepPlan) -> tuple[list[_Work], dict[str, SequenceResult]]:
        from services.attention.kv_pool import KVPoolError
        from services.attention.slots import SlotError

        work, errors = [], {}
        if plan.prefix_restores:
            for restore in plan.prefix_restores:
                errors[restore.request_id] = SequenceResult(restore.request_id, (), error="prefix restore is not "
                                                            "supported by this attention worker yet")
        for scheduled in plan.sequences:
            if scheduled.request_id in errors:
                continue
            if scheduled.draft_token_ids:
                errors[scheduled.request_id] = SequenceResult(scheduled.request_id, (), error="draft verification "
                                                              "is not supported by this attention worker yet")
                continue
            try:
                slot = self.slots.prepare(scheduled.seq_slot, scheduled.request_id, scheduled.start_position,
                                          scheduled.block_ids[0] if scheduled.block_ids else (), scheduled.sampling)
            except (SlotError, KVPoolError, ValueError) as error:
                errors[scheduled.request_id] = SequenceResult(scheduled.request_id, (), error=str(error)[:300])
                continue
            if not slot.output_token_ids:
                slot.prompt_token_ids.extend(scheduled.token_ids)
            work.append(_Work(scheduled, slot))
        return work, errors

    def _micro_batch_inputs(self, items: list[_Work]):
        from common.model.batch import SequenceChunk

        token_ids = torch.tensor([t for item in items for t in item.scheduled.token_ids], dtype=torch.long)
        chunks = [SequenceChunk(item.slot.state, len(item.scheduled.token_ids)) for item in items]
        return token_ids.to(self.device, non_blocking=True), chunks

    def _sampling_logits(self, work: list[_Work], groups: list[range], finals: list[torch.Tensor]
                         ) -> torch.Tensor | None:
        rows = []
        for group, h in zip(groups, finals):
            ends = []
            offset = 0
            for index in group:
                offset += len(work[index].scheduled.token_ids)
                if work[index].scheduled.do_sample:
                    ends.append(offset - 1)
            if ends:
                rows.append(self.side.logits(h, torch.tensor(ends, device=self.device)))  # [b, V]
        return torch.cat(rows) if rows else None

    def _sample(self, work: list[_Work], logits: torch.Tensor | None) -> dict[str, SequenceResult]:
        from services.attention.sampling import Purpose, stream

        sampling = [item for item in work if item.scheduled.do_sample]
        results = {item.scheduled.request_id: SequenceResult(item.scheduled.request_id, ()) for item in work
                   if not item.scheduled.do_sample}
        if not sampling:
            return results
        slots = [item.slot for item in sampling]
        generators = [None if slot.seed is None else stream(slot.seed, Purpose.SAMPLE, len(slot.output_token_ids),
                                                            self.device) for slot in slots]
        out = self.sampler.sample(logits, [s.params for s in slots], generators,
                                  [s.prompt_token_ids for s in slots], [s.output_token_ids for s in slots])
        token_ids = out.token_ids.tolist()  # the one host sync the step needs
        wants_logprobs = any(slot.params.num_logprobs is not None for slot in slots)
        chosen = out.logprobs.tolist() if wants_logprobs else None
        top_ids = out.top_logprob_ids.tolist() if wants_logprobs else None
        top_values = out.top_logprobs.tolist() if wants_logprobs else None
        for row, (item, slot) in enumerate(zip(sampling, slots)):
            slot.output_token_ids.append(token_ids[row])
            logprobs = None
            if slot.params.num_logprobs is not None:
                k = slot.params.num_logprobs
                logprobs = TokenLogprobs(logprobs=(chosen[row],), top_token_ids=(tuple(top_ids[row][:k]),),
                                         top_logprobs=(tuple(top_values[row][:k]),))
            results[item.scheduled.request_id] = SequenceResult(item.scheduled.request_id, (token_ids[row],),
                                                                logprobs=logprobs)
        return results
