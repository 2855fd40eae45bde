"""The expert worker: holds the (layer, expert) pairs its placement assigns, answers Dispatch.

One visible loop, `handle_dispatch(dispatch) -> Combine`: group the selected (token, slot)
pairs by expert, run each SwiGLU expert once on its group, scatter back, then either add the
owned slots per token in slot order (a partial sum [T, D]) or, in placement-invariant mode,
return every slot's weighted output [T, K, D] (zeros for slots that are not ours) so that the
attention worker adds all K slots in slot order itself.

Weights are read with `CheckpointReader.load_experts`, which reads only the requested pairs'
entries, and live on one torch device. Admin messages (`LoadExperts`, `DropExperts`,
`QueryInventory`) change or report what is held; each answers with an `ExpertInventory`.

Data path: a Dispatch's tensors go to the device through a `RecvStagingRing` (pinned landing
slots and asynchronous host->device copies on CUDA; the received frames as they are on the
CPU). The Combine leaves from a fixed `SendStagingPool` (`reply_staging`, read by the service
runner when it sends the reply): the output stays on the device and is copied straight into a
pinned, recycled buffer, which is reused only after ZeroMQ released the frames. A reply larger
than one buffer is sent from its own host tensor instead (`num_unstaged_replies`); it is a
fresh tensor per dispatch, never written again, so the zero-copy send is safe.
Legend: T tokens, K top-k slots, D hidden.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from common.model.config import ModelConfig
from common.runtime.service import Service
from common.wire.staging import RecvStagingRing, SendStagingPool, StagingConfig
from common.wire.messages import (
    AttachCudaIpc, Combine, Dispatch, DispatchSlot, DropExperts, ErrorCode, ErrorReply, ExpertInventory, ExpertKey,
    LoadExperts, QueryInventory,
)
from services.expert.ipc_plane import ExpertSlotPlane
from services.expert.grouping import ExpertGroups, group_by_expert, slot_outputs
from common.model.moe import sum_slots_in_order

log = structlog.get_logger("expert")

Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # w1 [I, D], w2 [D, I], w3 [I, D]


@dataclass(frozen=True)
class ExpertWorkerConfig:
    """name: service name; checkpoint_path: model directory; pairs: (layer, expert) held at start;
    dtype: "auto" (float32 on CPU, bfloat16 elsewhere) or a torch dtype name."""

    name: str
    checkpoint_path: str
    device: str = "cpu"
    dtype: str = "auto"
    pairs: tuple[tuple[int, int], ...] = ()
    route_weight_before_w2: bool = False
    num_reply_buffers: int = 4  # Combine staging buffers (pinned on CUDA hosts)
    reply_buffer_bytes: int = 32 << 20
    num_recv_slots: int = 4  # Dispatch landing slots (CUDA devices only)
    recv_slot_bytes: int = 32 << 20
    # Routed-expert bytes the startup budget leaves this worker (common/placement/worker_budget.py);
    # LoadExperts beyond it is refused, the inventory reports what is left. None: unchecked.
    expert_budget_bytes: int | None = None


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r} is not auto, float32, bfloat16 or float16")
    return getattr(torch, dtype)


def device_memory(device: torch.device) -> tuple[int, int | None]:
    """(bytes used, bytes total or None): allocator bytes on CUDA, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), None
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None


class ExpertWorker(Service):
    accepts = (Dispatch, LoadExperts, DropExperts, QueryInventory, AttachCudaIpc, DispatchSlot)
    uses_landing_ring = True  # received host tensors go up through RecvStagingRing (CUDA devices)

    def __init__(self, config: ExpertWorkerConfig, model_config: ModelConfig | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self._model_config = model_config
        self._weights: dict[tuple[int, int], Weights] = {}
        self.placement_version = 0
        self.read_entry_names: list[str] = []  # every checkpoint entry this worker read
        self.num_dispatches = 0
        self.num_unstaged_replies = 0
        self._reply_pool: SendStagingPool | None = None
        self._recv_ring: RecvStagingRing | None = None
        self._last_reply_fits = True
        self.slot_plane = ExpertSlotPlane(self.device, config.name)  # CUDA IPC rings of attention workers
        # Optional stacked holder of quantized experts (`QuantizedRoutedExperts`, e.g. random weights
        # in `bench layers --disaggregated`): when set, Dispatches are computed by its grouped kernels.
        self.holder: Any = None
        # CUDA graphs of the holder's per-layer work by token bucket (services/expert/graphs.py); None: eager
        self.graphs: Any = None

    @property
    def reply_staging(self) -> SendStagingPool | None:
        """The pool the runner sends the current reply from; None when it does not fit a buffer.
        Valid between `handle` and the reply, which the runner does one message at a time."""
        return self._reply_pool if self._last_reply_fits else None

    def allocate_staging(self) -> None:
        """The reply pool and, where the class uses one, the landing ring (done by `load`; call it when
        driving the worker directly)."""
        if self._reply_pool is None:
            self._reply_pool = SendStagingPool(StagingConfig(num_buffers=self.config.num_reply_buffers,
                                                             buffer_bytes=self.config.reply_buffer_bytes))
            if self.uses_landing_ring:
                self._recv_ring = RecvStagingRing(str(self.device), num_slots=self.config.num_recv_slots,
                                                  slot_bytes=self.config.recv_slot_bytes)

    def _to_device(self, received: torch.Tensor) -> torch.Tensor:
        """A received (read-only, host) tensor on this worker's device, through the landing ring when
        there is one, else by a plain copy."""
        if received.is_cuda:  # a CUDA IPC ring view: here already, or a peer copy from the attention GPU
            return received.to(self.device)
        if self._recv_ring is None or received.numel() * received.element_size() > self.config.recv_slot_bytes:
            return received.to(self.device)
        return self._recv_ring.to_device(received)

    # ------------------------------------------------------------------ lifecycle
    async def load(self) -> None:
        self.allocate_staging()
        self.load_pairs(self.config.pairs, self.config.checkpoint_path)

    def load_pairs(self, pairs, checkpoint_path: str) -> None:
        from common.checkpoint.reader import CheckpointReader

        wanted = sorted({(int(l), int(e)) for l, e in pairs} - set(self._weights))
        reader = CheckpointReader(checkpoint_path, config=self._model_config, on_progress=self.load_progress)
        self._model_config = reader.config
        loaded = reader.load_experts(reader.config, wanted, self.dtype)
        for pair, weights in loaded.items():
            self._weights[pair] = tuple(w.to(self.device).contiguous() for w in weights)
        self.read_entry_names.extend(reader.read_entry_names)
        log.info("expert.loaded", name=self.config.name, num_pairs=len(self._weights), num_new=len(wanted),
                 device=str(self.device), num_weight_bytes=self.num_weight_bytes())

    @property
    def swiglu_limit(self) -> float | None:
        return self._model_config.swiglu_limit if self._model_config is not None else None

    # ------------------------------------------------------------------ the loop
    async def handle(self, message: Any) -> Any:
        self._last_reply_fits = True
        match message:
            case Dispatch():
                return self.handle_dispatch(message)
            case LoadExperts(placement_version=version, experts=keys, checkpoint_path=path):
                refusal = self._load_refusal([(k.layer, k.expert) for k in keys])
                if refusal is not None:
                    return refusal
                self.load_pairs([(k.layer, k.expert) for k in keys], path or self.config.checkpoint_path)
                self.placement_version = version
                return self.inventory()
            case DropExperts(placement_version=version, experts=keys):
                for key in keys:
                    self._weights.pop((key.layer, key.expert), None)
                self.placement_version = version
                return self.inventory()
            case QueryInventory():
                return self.inventory()
            case AttachCudaIpc():
                return self.slot_plane.attach(message)
            case DispatchSlot():
                return self.handle_dispatch_slot(message)
        return ErrorReply(code=ErrorCode.UNEXPECTED, message=f"{type(message).TYPE} not handled")

    @torch.inference_mode()
    def handle_dispatch(self, dispatch: Dispatch) -> Combine | ErrorReply:
        """Dispatch -> Combine: grouped expert compute on this worker's slots, in a fixed order."""
        inputs = self._dispatch_inputs(dispatch)
        if isinstance(inputs, ErrorReply):
            return inputs
        groups = None
        if self.holder is None and not dispatch.expert_ids.is_cuda:  # host ids (ZeroMQ): group them here, no sync
            groups = group_by_expert(dispatch.expert_ids.long(), dispatch.slot_mask).moved(self._to_device)
        output = self.expert_output(dispatch.layer, *inputs, dispatch.per_expert_outputs, groups=groups)
        if isinstance(output, ErrorReply):
            return output
        return self._combine_reply(dispatch, output)

    def _dispatch_inputs(self, dispatch: Dispatch):
        """The Dispatch's tensors on this worker's device -> (hidden [T, D], ids [T, K] long,
        route weights [T, K] f32, slot mask [T, K] bool or None), or MALFORMED when shapes disagree."""
        self.num_dispatches += 1
        hidden = self._to_device(dispatch.hidden).to(self.dtype)  # [T, D]
        ids = self._to_device(dispatch.expert_ids).long()  # [T, K]
        route_weights = self._to_device(dispatch.weights)  # [T, K] f32
        mask = None if dispatch.slot_mask is None else self._to_device(dispatch.slot_mask)  # [T, K] bool
        if ids.shape != route_weights.shape or ids.shape[0] != hidden.shape[0] or (
                mask is not None and mask.shape != ids.shape):
            return ErrorReply(code=ErrorCode.MALFORMED, message=f"dispatch shapes disagree: hidden "
                              f"{tuple(hidden.shape)}, ids {tuple(ids.shape)}, weights {tuple(route_weights.shape)}")
        return hidden, ids, route_weights, mask

    def _combine_reply(self, dispatch: Dispatch, output: torch.Tensor) -> Combine:
        """The Combine answering dispatch; output leaves from a staging buffer when it fits one."""
        self._last_reply_fits = (self._reply_pool is not None and output.numel() * output.element_size() + 64
                                 <= self._reply_pool.config.buffer_bytes)
        if not self._last_reply_fits:
            self.num_unstaged_replies += self._reply_pool is not None
            output = output.cpu()  # sent zero-copy from this fresh host tensor
        return Combine(dispatch_id=dispatch.dispatch_id, step_id=dispatch.step_id, layer=dispatch.layer,
                       micro_batch=dispatch.micro_batch, output=output,
                       per_expert_outputs=dispatch.per_expert_outputs)

    def expert_output(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor,
                      mask: torch.Tensor | None, per_expert_outputs: bool,
                      groups: ExpertGroups | None = None) -> torch.Tensor | ErrorReply:
        """The routed answer [T, D] (or [T, K, D]) for this worker's slots, whatever the data plane.
        groups: `group_by_expert(ids, mask)` when the caller has it (from host ids: no device sync)."""
        if self.holder is not None:
            from common.model.moe import ExpertNotHeld

            if self.graphs is not None:  # a static graph output, valid until the next Dispatch
                try:
                    replayed = self.graphs.run(layer, hidden, ids, route_weights, mask, per_expert_outputs)
                except RuntimeError as error:  # a capture that fails turns graphs off, never the worker
                    log.warning("expert.graphs_off", name=self.config.name, reason=str(error)[:300])
                    self.graphs, replayed = None, None
                if replayed is not None:
                    return replayed
            try:
                per_slot = self.holder.per_expert_outputs(layer, hidden, ids, route_weights, mask)  # [T, K, D]
            except ExpertNotHeld as error:
                return ErrorReply(code=ErrorCode.NOT_FOUND, message=f"{self.config.name}: {error}"[:300])
        else:
            groups = groups if groups is not None else group_by_expert(ids, mask)
            missing = [e for e in groups.expert_ids if (layer, e) not in self._weights]
            if missing:
                return ErrorReply(code=ErrorCode.NOT_FOUND,
                                  message=f"{self.config.name} does not hold layer {layer} experts {missing}")
            per_slot = slot_outputs(self._weights, layer, hidden, groups, route_weights, ids.shape[1],
                                    self.swiglu_limit, self.config.route_weight_before_w2)  # [T, K, D]
        return per_slot if per_expert_outputs else sum_slots_in_order(per_slot)

    @torch.inference_mode()
    def handle_dispatch_slot(self, message: DispatchSlot) -> Any:
        """DispatchSlot -> CombineSlot: `handle_dispatch` (a subclass's too) on the ring's device views."""
        inputs = self.slot_plane.inputs(message)
        if isinstance(inputs, ErrorReply):
            return inputs
        hidden, ids, route_weights, mask = inputs
        if self.graphs is not None and self.holder is not None and mask is None:  # the lean path: one replay
            self.num_dispatches += 1
            try:
                replayed = self.graphs.run(message.layer, hidden, ids, route_weights, None,
                                           message.per_expert_outputs)
            except RuntimeError as error:  # a capture that fails turns graphs off, never the worker
                log.warning("expert.graphs_off", name=self.config.name, reason=str(error)[:300])
                self.graphs, replayed = None, None
            if replayed is not None:
                return self.slot_plane.reply(message, replayed)
            self.num_dispatches -= 1  # counted again by handle_dispatch
        reply = self.handle_dispatch(Dispatch(
            dispatch_id=message.dispatch_id, step_id=message.step_id, layer=message.layer,
            micro_batch=message.micro_batch, hidden=hidden, expert_ids=ids, weights=route_weights,
            per_expert_outputs=message.per_expert_outputs, slot_mask=mask))
        if not isinstance(reply, Combine):
            return reply
        return self.slot_plane.reply(message, reply.output.to(hidden.dtype))

    # ------------------------------------------------------------------ reports
    def num_weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for weights in self._weights.values() for w in weights)

    def inventory(self) -> ExpertInventory:
        used, total = device_memory(self.device)
        budget = self.config.expert_budget_bytes
        return ExpertInventory(
            name=self.config.name, device=str(self.device), placement_version=self.placement_version,
            experts=tuple(ExpertKey(layer=l, expert=e) for l, e in sorted(self._weights)),
            num_weight_bytes=self.num_weight_bytes(), memory_used_bytes=used, memory_total_bytes=total,
            free_budget_bytes=None if budget is None else budget - self.num_weight_bytes())

    def _load_refusal(self, pairs) -> ErrorReply | None:
        """ErrorReply naming the device and the shortfall when `pairs` do not fit the budget left."""
        budget = self.config.expert_budget_bytes
        new = {(int(l), int(e)) for l, e in pairs} - set(self._weights)
        if budget is None or not new or self._model_config is None:
            return None
        from common.placement.worker_budget import bytes_per_expert
        from services.expert.random_weights import is_random_model

        if self._weights:  # what the held experts really take (dense, or kept quantized)
            per_expert = -(-self.num_weight_bytes() // len(self._weights))
        else:
            per_expert = bytes_per_expert(self._model_config, torch.empty((), dtype=self.dtype).element_size(),
                                          keep_quantized=is_random_model(self.config.checkpoint_path))
        needed = self.num_weight_bytes() + len(new) * per_expert
        if needed <= budget:
            return None
        from common.placement.devices import format_bytes

        log.error("expert.load_refused", name=self.config.name, device=str(self.device), num_new=len(new),
                  needed_bytes=needed, budget_bytes=budget)
        return ErrorReply(code=ErrorCode.OVERLOADED, message=(
            f"{self.config.name} on {self.device}: {len(new)} more experts need {format_bytes(needed)} in all, the "
            f"budget for experts is {format_bytes(budget)}; short by {format_bytes(needed - budget)}"))
