"""The attention worker: executes StepPlans (docs/design.md §2 steps 3 and 5).

`step(plan) -> StepResult` is the one entry (retries: recovery.StepRecovery) and the one visible loop:

    move KV blocks (swap_out, swap_in)          kv_pool.KVPool.move
    restore slots from blocks (prefix hits,     slots.SlotTable.restore (boundary.py)
      swap-ins) at a block boundary
    position each sequence in its slot          slots.SlotTable.prepare
    split the sequences into micro-batches      split_micro_batches
    run the layers, dispatching routed experts  model_runner.ModelRunner.run_segments (eager or graph replays)
    target features, drafter in this process    local_drafter.LocalDrafter.send (every row, while the device
                                                  computes; the rings drop rejected rows before a draft)
    logits of the sequences that sample         step_sampling.sampling_logits (AttentionSide.logits)
    sample (+ logprobs), or verify drafts       step_sampling.sample_or_verify (sampling.Sampler;
                                                  draft_verification.verify_drafted rolls back rejects)
    target features to a draft worker process   speculation.FeatureSender (committed rows, before the StepResult)
    next drafts, drafter in this process        local_drafter.LocalDrafter (in the StepResult)
    release finished slots                      slots.SlotTable.free

It holds everything of the model except the routed experts, which it reaches through
`MoEDispatcher` (one Dispatch per expert worker per MoE layer and micro-batch), save those its own
placement entry gives it (`local_holdings`, local_experts.py), which the dispatcher computes here. Stop tokens
and max_tokens are the router's business: the worker returns the token it sampled.
Legend: B sequences that sample, V vocab, K top logprobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from moemesh.common.runtime.service import Service
from moemesh.common.wire.messages import (
    EndWarmUp, ErrorCode, ErrorReply, RoutingStatsWritten, ScheduledSequence, SequenceResult, StepPlan, StepResult,
    SwitchPlacement, WriteRoutingStats,
)
from moemesh.services.attention.kv_capacity import log_kv_capacity
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.services.attention.mailbox_plane import MailboxConfig
from moemesh.services.attention.recovery import RecoveryConfig, build_step_recovery
from moemesh.services.attention.routing_config import RoutingStatsConfig
from moemesh.services.attention.step_counters import StepCounting
from moemesh.services.attention.step_phases import StepPhases, step_kind
from moemesh.services.attention.step_profiler import StepProfiler
from moemesh.services.attention.step_sampling import masked_logits, sample_or_verify, sampling_logits, token_mask_problem
from moemesh.common.placement.worker_holdings import WorkerHoldings, owner_table

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
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)  # retries after a lost expert worker
    draft_endpoint: str | None = None  # the draft worker, to send target features to (None: no drafter)
    draft_timeout_s: float = 3.0  # features -> Ack; the step waits, so a dead drafter costs this once
    # the drafter in this process ([draft] placement = "attention"; local_drafter.py), None: not here
    drafter: Any = None  # common.drafting.proposer.DrafterConfig
    routing_stats: RoutingStatsConfig = field(default_factory=RoutingStatsConfig)
    security: Any = None  # common.security.SocketSecurity for the expert sockets (None: plain)
    # "zmq" (tensor frames via pinned host staging) or "cuda_ipc" (shared device rings + ZeroMQ doorbell, for
    # expert workers on this host and CUDA; others fall back to zmq with a log event): common/wire/cuda_ipc.py
    data_plane: str = "zmq"
    replica_policy: str = "least_loaded"  # how replicas share a pair's tokens: least_loaded | round_robin
    # CUDA graphs of decode steps by batch-size bucket (services/attention/graph_decode.py; CUDA devices only;
    # prefill, verification and steps that do not fit a bucket run eagerly)
    cuda_graphs: bool = False
    # (layer, expert) pairs this worker holds and computes itself (its `[[attention]] placement`); None: none
    local_holdings: WorkerHoldings | None = None
    # data_plane "mailbox": rows per mailbox, how long a layer waits for a worker (mailbox_plane.py)
    mailbox: MailboxConfig = field(default_factory=MailboxConfig)


def split_micro_batches(num_sequences: int, num_micro_batches: int) -> list[range]:
    """Contiguous groups of sequence indices, as even as possible, none empty."""
    count = max(1, min(num_micro_batches, num_sequences))
    return [range(i * num_sequences // count, (i + 1) * num_sequences // count) for i in range(count)]


@dataclass
class _Work:
    scheduled: ScheduledSequence
    slot: Any  # slots.Slot


class AttentionWorker(Service):
    accepts = (StepPlan, WriteRoutingStats, SwitchPlacement, EndWarmUp)

    def __init__(self, config: AttentionWorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.last_logits: torch.Tensor | None = None

    async def load(self) -> None:
        self.load_now()

    def load_now(self) -> None:
        import zmq

        from moemesh.common.checkpoint.module_loader import module_weight_bytes
        from moemesh.common.checkpoint.reader import CheckpointReader
        from moemesh.common.checkpoint.side_loading import WeightBytes, attention_stored_bytes, load_attention_side
        from moemesh.common.model.config import NumericsConfig, resolve_dtype
        from moemesh.common.model.kv_storage import KVStorage
        from moemesh.services.attention.expert_channel import ExpertChannel
        from moemesh.services.attention.kv_pool import KVPool
        from moemesh.services.attention.model_runner import ModelRunner
        from moemesh.services.attention.moe_dispatch import MoEDispatcher
        from moemesh.services.attention.placement_switch import pair_holders
        from moemesh.services.attention.routing_stats import RoutingCounter
        from moemesh.services.attention.sampling import Sampler
        from moemesh.services.attention.slots import SlotTable
        from moemesh.common.wire.cuda_ipc import DataPlane

        if DataPlane(self.config.data_plane) is DataPlane.MAILBOX and self.config.num_micro_batches > 1:
            raise ValueError(f"data plane mailbox carries one micro-batch at a time; num_micro_batches is "
                             f"{self.config.num_micro_batches}")
        dtype = resolve_dtype(self.config.dtype, self.config.device)
        reader = CheckpointReader(self.config.checkpoint_path, on_progress=self.load_progress)
        model_config = reader.config
        # FP8 rows: every row is rounded to its stored values before anything reads it (the reference's KV QAT),
        # so a row reads the same in the forward that makes it and in every later one, whatever the chunking
        kv_fp8 = self.config.kv.kv_storage is KVStorage.FP8
        numerics = NumericsConfig(dtype=str(dtype).removeprefix("torch."), kv_fp8_qat=kv_fp8)
        self.side = load_attention_side(reader, numerics, self.device)
        endpoints, workers, local = self._local_experts(reader, dtype)
        if local is not None:
            local.connect_gates(self.side.gates())
        self.weight_bytes = WeightBytes(resident=module_weight_bytes(self.side) + local_bytes(local, "resident"),
                                        stored=attention_stored_bytes(reader) + local_bytes(local, "stored"))
        self.report_weight_bytes(self.device, self.weight_bytes.resident, self.weight_bytes.stored)
        self.pool = KVPool(model_config, self.config.kv, self.side.dtype, self.device)
        self.slots = SlotTable(model_config, self.pool, self.side.dtype, self.device)
        self._zmq_context = zmq.Context()
        self.channel = ExpertChannel(endpoints, context=self._zmq_context,
                                     timeout_s=self.config.dispatch_timeout_s, security=self.config.security)
        owner = owner_table(workers, model_config.num_hidden_layers, model_config.n_routed_experts)
        self.dispatcher = MoEDispatcher(self.channel, owner, placement_invariant=self.config.placement_invariant,
                                        device=self.device, replica_policy=self.config.replica_policy,
                                        data_plane=DataPlane(self.config.data_plane), local_experts=local,
                                        mailbox=self.config.mailbox, channel_prefix=self.config.name,
                                        model_shape=(model_config.hidden_size, model_config.num_experts_per_tok,
                                                     self.side.dtype))
        self.dispatcher.slot_owners.set_holders(pair_holders(workers, model_config.num_hidden_layers,
                                                 model_config.n_routed_experts))  # replicas share load from the start
        self.routing = RoutingCounter(model_config.num_hidden_layers, model_config.n_routed_experts,
                                      model_config.num_experts_per_tok, self.device,
                                      self.config.routing_stats.summary_every_steps)
        self.runner = ModelRunner(self.side, self.dispatcher, self.routing)
        if self.config.cuda_graphs and self.device.type == "cuda":
            from moemesh.services.attention.graph_decode import DecodeGraphConfig, DecodeGraphs

            kv = self.config.kv  # no request is longer than the model's positions: tables need no wider rows
            max_blocks = min(kv.num_primary_blocks, -(-model_config.max_position_embeddings // kv.block_size_tokens))
            self.runner.graphs = DecodeGraphs(
                self.side, DecodeGraphConfig(max_blocks_per_sequence=max_blocks, kv_storage=kv.kv_storage),
                self.device)
        self.sampler = Sampler()
        self.recovery = build_step_recovery(self)
        self.counting = StepCounting(self.channel, self.device, model_config.num_hidden_layers)
        self.phases = StepPhases(self.device)  # where step time goes, logged at close
        self.profiler = StepProfiler.from_env(self.config.name, self.device)  # MOEMESH_TORCH_PROFILE_STEPS
        self._install_speculation(model_config)
        log.info("attention.loaded", name=self.config.name, device=str(self.device), dtype=str(dtype),
                 num_expert_workers=len(self.config.expert_endpoints),
                 num_local_experts=0 if local is None else len(local.pairs), num_micro_batches=self.config.num_micro_batches,
                 placement_invariant=self.config.placement_invariant, kv_bytes_per_block=self.pool.num_bytes_per_block(),
                 kv_bytes_per_snapshot=self.pool.num_bytes_per_snapshot(),
                 resident_weight_bytes=self.weight_bytes.resident, stored_weight_bytes=self.weight_bytes.stored,
                 cuda_graphs=self.runner.graphs is not None)
        log_kv_capacity(self.config.name, self.pool.sizing, str(self.device))

    def _local_experts(self, reader, dtype: torch.dtype):
        """(channel endpoints, their holdings, LocalExperts or None): the expert workers, then this worker
        itself (`local:<name>`) when its placement gives it pairs, which are loaded here."""
        endpoints, workers = list(self.config.expert_endpoints), list(self.config.expert_workers)
        holdings = self.config.local_holdings
        if holdings is None or not holdings.held:
            return endpoints, workers, None
        from moemesh.services.attention.expert_channel import local_endpoint
        from moemesh.services.attention.local_experts import LocalExperts

        local = LocalExperts(self.device, dtype)
        local.load(reader, holdings.held)
        return [*endpoints, local_endpoint(self.config.name)], [*workers, holdings], local

    async def handle(self, message: Any) -> Any:
        match message:
            case StepPlan():
                return self.step(message)
            case WriteRoutingStats(path=path):
                return self.write_routing_stats(path or None)
            case SwitchPlacement():  # between two steps: a StepPlan runs within one handle()
                from moemesh.services.attention.placement_switch import apply_switch

                return apply_switch(self, message)
            case EndWarmUp():  # the router's warm-up is over: its routing counts go (warm_up_end.py)
                from moemesh.services.attention.warm_up_end import end_warm_up

                return end_warm_up(self)
        return ErrorReply(code=ErrorCode.UNEXPECTED, message=f"{type(message).TYPE} not handled")

    def write_routing_stats(self, path: str | None = None) -> RoutingStatsWritten | ErrorReply:
        """Write the routing hotness tables to `path` (default: the configured out_path)."""
        target = path or self.config.routing_stats.out_path
        if target is None:
            return ErrorReply(code=ErrorCode.NOT_FOUND, message="no routing statistics path: pass one or start "
                              "the attention worker with --routing-stats-out FILE")
        written = self.routing.write(target)
        return RoutingStatsWritten(paths=tuple(str(p) for p in written), summary=self.routing.summary())

    async def close(self) -> None:
        if getattr(self, "profiler", None) is not None:
            self.profiler.close()
        if getattr(self, "phases", None) is not None and self.phases.by_kind:
            log.info("attention.step_phase_summary", **self.phases.as_log_fields())
        if hasattr(self, "routing") and self.config.routing_stats.out_path is not None:
            self.routing.write(self.config.routing_stats.out_path)  # SIGTERM drains, then closes: stats land
        if getattr(self, "feature_sender", None) is not None:
            self.feature_sender.close()
        if getattr(self, "dispatcher", None) is not None and self.dispatcher.mailbox_plane is not None:
            self.dispatcher.mailbox_plane.close()  # the workers' loops stop, the segments are unlinked
        if hasattr(self, "channel"):
            self.channel.close()
            self._zmq_context.term()

    # ------------------------------------------------------------------ the loop
    def step(self, plan: StepPlan) -> StepResult:
        """The one step entry: block moves, then `_compute_step`, retried within a bound when an expert worker
        is lost (recovery.StepRecovery). `last_logits`: the logits [R, V] of the sequences that sampled (plan
        order; one row each, or 1 + drafts rows for a sequence with drafts) in the last computed attempt."""
        self.pool.move(plan.swap_out, plan.swap_in, plan.snapshot_swap_out, plan.snapshot_swap_in)
        self._step_routing = None
        with self.profiler.step(step_kind(plan)) if self.profiler is not None else contextlib.nullcontext():
            result = self.counting.count(plan, self.recovery.run)  # with its StepCounters
        if result.routing is None and self._step_routing is not None:  # recovery rebuilds the result without it
            result = dataclasses.replace(result, routing=self._step_routing)
        return result

    @torch.inference_mode()
    def _compute_step(self, plan: StepPlan) -> StepResult:
        """One attempt of `step` without the block moves (what a retry repeats)."""
        timer = self.phases.start()
        work, errors = self._prepare(plan)
        groups = split_micro_batches(len(work), self.config.num_micro_batches)
        micro_batches = [self._micro_batch_inputs([work[i] for i in group]) for group in groups]
        decode_masks = [self._decode_mask([work[i] for i in group]) for group in groups]
        timer.mark("prepare")
        timer.forward_started()
        finals = self.runner.forward(plan.step_id, micro_batches, decode_masks) if work else []
        timer.forward_done()
        timer.mark("forward")
        if self.local_drafter is not None:  # every row, while the device runs the forward (see _send_features)
            self._send_features(plan.step_id, work, groups, None)
            timer.mark("features")
        logits = sampling_logits(work, groups, finals, self.runner.step_logits, self.side, self.device)
        self.last_logits = logits
        results, rejected = sample_or_verify(work, masked_logits(work, logits, plan.token_masks), self.sampler,
                                             self.device)
        self.dispatcher.confirm_deferred()  # a step graph's mailbox waits: a lost worker fails the attempt here
        timer.mark("sample")
        if self.local_drafter is None:
            self._send_features(plan.step_id, work, groups, rejected)
            timer.mark("features")
        draft_s = 0.0 if self.local_drafter is None else self.local_drafter.propose_after_step(work, results)
        timer.mark("draft")
        self._free_slots(plan.free_seq_slots)
        log.debug("attention.step_done", step_id=plan.step_id, num_sequences=len(work),
                  num_micro_batches=len(groups), num_overlapped_runs=self.runner.stats.num_overlapped_runs)
        by_id = {**results, **errors}
        routing = self.routing.step_done() if work else None
        self._step_routing = routing  # for step(): the summary survives recovery's merge
        timer.finish(step_kind(plan))
        return StepResult(step_id=plan.step_id, sequences=tuple(by_id[s.request_id] for s in plan.sequences),
                          routing=routing, draft_s=draft_s)

    # ------------------------------------------------------------------ helpers
    def _prepare(self, plan: StepPlan) -> tuple[list[_Work], dict[str, SequenceResult]]:
        from moemesh.services.attention.kv_pool import KVPoolError
        from moemesh.services.attention.slots import SlotError

        work, errors = [], {}
        for restore in plan.prefix_restores:  # after the block moves, before compute (prefix hits, swap-ins)
            try:
                self.slots.restore(restore.seq_slot, restore.request_id, tuple(restore.block_ids), restore.num_tokens,
                                   restore.snapshot_id)
            except (SlotError, KVPoolError, ValueError) as error:
                errors[restore.request_id] = SequenceResult(restore.request_id, (), error=str(error)[:300])
        for scheduled in plan.sequences:
            if scheduled.request_id in errors:
                continue
            try:
                slot = self.slots.prepare(scheduled.seq_slot, scheduled.request_id, scheduled.start_position,
                                          scheduled.block_ids[0] if scheduled.block_ids else (), scheduled.sampling,
                                          scheduled.snapshot_targets)
            except (SlotError, KVPoolError, ValueError) as error:
                errors[scheduled.request_id] = SequenceResult(scheduled.request_id, (), error=str(error)[:300])
                continue
            try:
                if scheduled.sampling is not None:  # starts in this slot: its history comes with it
                    slot.begin_history(scheduled.start_position, scheduled.prior_token_ids, scheduled.num_prompt_tokens)
                    slot.client_request_id = scheduled.client_request_id
                num_known = len(scheduled.token_ids) - len(scheduled.draft_token_ids)
                slot.record_tokens(scheduled.start_position, scheduled.token_ids[:num_known])
            except SlotError as error:
                errors[scheduled.request_id] = SequenceResult(scheduled.request_id, (), error=str(error)[:300])
                continue
            problem = token_mask_problem(scheduled, plan.token_masks)
            if problem is not None:
                errors[scheduled.request_id] = SequenceResult(scheduled.request_id, (), error=problem)
                continue
            work.append(_Work(scheduled, slot))
        return work, errors

    def _micro_batch_inputs(self, items: list[_Work]):
        from moemesh.common.model.batch import SequenceChunk

        token_ids = torch.tensor([t for item in items for t in item.scheduled.token_ids], dtype=torch.long)
        chunks = [SequenceChunk(item.slot.state, len(item.scheduled.token_ids)) for item in items]
        return token_ids.to(self.device, non_blocking=True), chunks

    def _decode_mask(self, items: list[_Work]) -> torch.Tensor:
        """[T] bool: True for tokens of sequences that already generated output (decode), False for
        prompt tokens (prefill); the phase split of the routing statistics."""
        flags = [bool(item.slot.output_token_ids) for item in items for _ in item.scheduled.token_ids]
        return torch.tensor(flags, dtype=torch.bool).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ speculation
    def _install_speculation(self, model_config) -> None:
        """Capture the drafter's target layers and connect to the draft worker, if there is one."""
        from moemesh.services.attention.speculation import FeatureSender, capture_layer_ids

        self.feature_sender = None
        self.local_drafter = None
        self.max_feature_positions = model_config.sliding_window
        if self.config.drafter is not None and model_config.dspark is not None:
            from moemesh.services.attention.local_drafter import LocalDrafter

            progress = self.load_progress  # the drafter's bytes count on after the attention side's
            on_progress = None if progress is None else (
                lambda num_bytes, num_tensors, base=(progress.num_bytes, progress.num_tensors):
                progress(base[0] + num_bytes, base[1] + num_tensors))
            try:
                self.local_drafter = LocalDrafter(self.config.drafter, on_progress=on_progress)
            except Exception as error:  # noqa: BLE001 (serving goes on without drafts, and says so in Ready)
                self.ready_detail = f"drafter failed: {type(error).__name__}: {str(error)[:300]}"
                log.error("attention.drafter_failed", error=self.ready_detail, action="serving without speculation")
                return
            self.runner.capture_layer_ids = frozenset(capture_layer_ids(model_config))
            self.feature_sender = self.local_drafter
            return
        if self.config.draft_endpoint is None or model_config.dspark is None:
            return
        self.runner.capture_layer_ids = frozenset(capture_layer_ids(model_config))
        self.feature_sender = FeatureSender(self.config.draft_endpoint, self._zmq_context, self.config.draft_timeout_s)
        log.info("attention.features_to_drafter", endpoint=self.config.draft_endpoint,
                 layers=sorted(self.runner.capture_layer_ids))

    def _send_features(self, step_id: int, work: list[_Work], groups: list[range],
                       rejected: dict[str, int] | None) -> None:
        """TargetFeatures of the committed positions of every sequence the plan marks. rejected None: every
        row of every chunk, before verification has decided (the drafter in this process gets them while the
        device is still computing the forward, so their host work overlaps it; the rows of drafts that
        verification then rejects sit past the committed prefix in the rings, where the next append or the
        truncation to the seed position before the next draft drops them). The draft worker process gets the
        committed rows only, after verification."""
        from moemesh.services.attention.speculation import committed_rows, target_features_message

        if self.feature_sender is None or not any(item.scheduled.send_features for item in work):
            return
        rows = []
        for micro_batch, group in enumerate(groups):
            offset = 0
            for index in group:
                scheduled = work[index].scheduled
                if scheduled.send_features:
                    entry = committed_rows(scheduled.request_id, micro_batch, offset, scheduled.token_ids,
                                           scheduled.start_position,
                                           0 if rejected is None else rejected.get(scheduled.request_id, 0),
                                           self.max_feature_positions)
                    if entry is not None:
                        rows.append(entry)
                offset += len(scheduled.token_ids)
        if rows:
            self.feature_sender.send(target_features_message(  # the drafter in this process reads them in place
                step_id, rows, self.runner.captured, to_host=self.local_drafter is None))

    def _free_slots(self, seq_slots) -> None:
        if self.local_drafter is not None:  # a freed slot's request is finished or preempted: its ring goes too
            self.local_drafter.drop([slot.request_id for slot in map(self.slots.slots.get, seq_slots) if slot])
        self.slots.free(seq_slots)


def local_bytes(local, kind: str) -> int:
    """The local experts' resident or stored bytes (0 without local experts)."""
    return 0 if local is None else getattr(local.holdings, f"{kind}_bytes")()
