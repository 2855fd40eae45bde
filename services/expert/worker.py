"""The expert worker: holds the (layer, expert) pairs its placement assigns, answers Dispatch.

One visible loop, `handle_dispatch(dispatch) -> Combine`: select the (token, slot) rows whose
experts are held here, run each SwiGLU expert once on its rows, then either add the owned slots per
token in slot order (a partial sum [T, D]) or, in placement-invariant mode, return every slot's
weighted output [T, K, D] (zeros for slots that are not ours) so that the attention worker adds all
K slots in slot order itself.

Weights come from the checkpoint directory, read pair by pair from the memory-mapped shards straight
into the format the worker keeps (`common.checkpoint.expert_holdings.ExpertHoldings`, `--expert-dtype native|fp8|bf16`):
- FP4 / FP8 stacks per layer (`QuantizedRoutedExperts`): on CUDA with 16-bit activations the grouped
  Triton kernels on the selected rows; on the CPU the native FP4 kernel (`common.model.cpu_experts`), FP8 experts
  dequantised one matrix at a time. Row selection and the kernels' row layout run on the host from the
  received ids and mask (selection.py), so a ZeroMQ Dispatch needs no host sync before the reply's copy.
- dense matrices (float checkpoints, `bf16`): rows grouped by expert (grouping.py), each expert once.
Admin messages (`LoadExperts`, `DropExperts`, `QueryInventory`) change or report what is held; each
answers with an `ExpertInventory` that carries the resident and the stored bytes of the held experts;
a load beyond the worker's expert budget is refused (budget.py).

Data path: a Dispatch's tensors go to the device by plain copies for quantized holdings (with the
landing ring, several small tensors per Dispatch, the two-GPU ZeroMQ run at B = 64 took 12 ms per
Dispatch against 2.6 ms without it) and through a `RecvStagingRing` (pinned landing slots,
asynchronous host->device copies on CUDA) for dense ones; on the CPU the received frames are used as
they are. The Combine leaves from a fixed `SendStagingPool` (`reply_staging`, read by the service
runner when it sends the reply): the output stays on the device and is copied straight into a
pinned, recycled buffer, which is reused only after ZeroMQ released the frames. A reply larger
than one buffer is sent from its own host tensor instead (`num_unstaged_replies`); it is a
fresh tensor per dispatch, never written again, so the zero-copy send is safe.
Legend: T tokens, K top-k slots, D hidden, R selected (token, slot) rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from moemesh.common.model.config import ModelConfig, resolve_dtype
from moemesh.common.runtime.service import Service
from moemesh.common.wire.staging import RecvStagingRing, SendStagingPool, StagingConfig
from moemesh.common.wire.messages import (
    AttachCudaIpc, AttachMailbox, Combine, Dispatch, DispatchSlot, DropExperts, ErrorCode, ErrorReply, ExpertInventory,
    LoadExperts, MailboxAttached, QueryInventory,
)
from moemesh.common.checkpoint.expert_stacks import ExpertDtype, ResidentFormat
from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.services.expert.budget import expert_inventory, load_refusal
from moemesh.services.expert.grouping import group_by_expert, slot_outputs
from moemesh.common.checkpoint.expert_holdings import ExpertHoldings
from moemesh.services.expert.ipc_plane import ExpertSlotPlane
from moemesh.services.expert.mailbox_plane import ExpertMailboxes
from moemesh.services.expert.selection import (
    HeldTable, RowSelection, held_tables, routing_on_host, select_rows, sorted_layout,
)

log = structlog.get_logger("expert")


@dataclass(frozen=True)
class ExpertWorkerConfig:
    """name: service name; checkpoint_path: model directory; pairs: (layer, expert) held at start;
    dtype: "auto" (float32 on CPU, bfloat16 elsewhere) or a torch dtype name (activations);
    expert_dtype: "native", "fp8" or "bf16" (what is kept of the routed experts, common/checkpoint/expert_holdings.py)."""

    name: str
    checkpoint_path: str
    device: str = "cpu"
    dtype: str = "auto"
    pairs: tuple[tuple[int, int], ...] = ()
    expert_dtype: str = "native"
    route_weight_before_w2: bool = False
    num_reply_buffers: int = 4  # Combine staging buffers (pinned on CUDA hosts)
    reply_buffer_bytes: int = 32 << 20
    num_recv_slots: int = 4  # Dispatch landing slots (CUDA devices only)
    recv_slot_bytes: int = 32 << 20
    # Routed-expert bytes the startup budget leaves this worker (common/placement/worker_budget.py);
    # LoadExperts beyond it is refused, the inventory reports what is left. None: unchecked.
    expert_budget_bytes: int | None = None


class ExpertWorker(Service):
    accepts = (Dispatch, LoadExperts, DropExperts, QueryInventory, AttachCudaIpc, DispatchSlot, AttachMailbox)

    def __init__(self, config: ExpertWorkerConfig, model_config: ModelConfig | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self._model_config = model_config
        self.holdings = ExpertHoldings(self.device, ExpertDtype(config.expert_dtype), config.route_weight_before_w2)
        self.placement_version = 0
        self.read_entry_names: list[str] = []  # every checkpoint entry this worker read
        self.num_dispatches = 0
        self.num_unstaged_replies = 0
        self.num_empty_selections = 0  # Dispatches with tokens but no selected slot here (must stay 0)
        self._reply_pool: SendStagingPool | None = None
        self._recv_ring: RecvStagingRing | None = None
        self._last_reply_fits = True
        self._cpu_runner = None  # common.model.cpu_experts.CpuBlockRunner: FP4 blocks on a thread pool (CPU devices)
        self._tables: dict[int, HeldTable] = {}  # host held/stack-index tables per layer (selection.py)
        self._tables_of = None  # the holder they were built from
        self.slot_plane = ExpertSlotPlane(self.device, config.name)  # CUDA IPC rings of attention workers
        self.mailboxes = ExpertMailboxes(self.device, config.name)  # host-memory mailboxes (native loops)
        # CUDA graphs of the quantized holder's per-layer work by token bucket (services/expert/graphs.py); None: eager
        self.graphs: Any = None

    @property
    def _experts(self):
        """The quantized holder (`QuantizedRoutedExperts`) or None for dense holdings."""
        return self.holdings.experts

    @property
    def reply_staging(self) -> SendStagingPool | None:
        """The pool the runner sends the current reply from; None when it does not fit a buffer.
        Valid between `handle` and the reply, which the runner does one message at a time."""
        return self._reply_pool if self._last_reply_fits else None

    def allocate_staging(self) -> None:
        """The reply pool and, for dense holdings, the landing ring (done by `load`; call it when driving
        the worker directly)."""
        if self._reply_pool is None:
            self._reply_pool = SendStagingPool(StagingConfig(num_buffers=self.config.num_reply_buffers,
                                                             buffer_bytes=self.config.reply_buffer_bytes))
        if self.holdings.format is ResidentFormat.DENSE and self._recv_ring is None:
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
        self.load_pairs(self.config.pairs, self.config.checkpoint_path)
        self.allocate_staging()

    def load_pairs(self, pairs, checkpoint_path: str) -> None:
        import time

        from moemesh.common.checkpoint.reader import CheckpointReader

        started = time.monotonic()
        reader = CheckpointReader(checkpoint_path, config=self._model_config, on_progress=self.load_progress)
        self._model_config = reader.config
        new = self.holdings.load(reader, pairs)
        self.read_entry_names.extend(reader.read_entry_names)
        if self.device.type == "cpu" and self.holdings.format is ResidentFormat.FP4 and self._cpu_runner is None:
            from moemesh.common.model.cpu_experts import CpuBlockRunner

            # parallel over FP4 blocks on Python threads, each torch op single-threaded (see CpuBlockRunner)
            self._cpu_runner = CpuBlockRunner(torch.get_num_threads())
            torch.set_num_threads(1)
        log.info("expert.loaded", name=self.config.name, num_pairs=len(self.holdings), num_new=len(new),
                 device=str(self.device), expert_format=self.holdings.format.value if self.holdings.format else None,
                 resident_weight_bytes=self.holdings.resident_bytes(),
                 stored_weight_bytes=self.holdings.stored_bytes(), num_bytes_read=reader.num_bytes_read,
                 load_s=round(time.monotonic() - started, 3))
        self.report_weight_bytes(self.device, self.holdings.resident_bytes(), self.holdings.stored_bytes())

    async def close(self) -> None:
        self.mailboxes.close()  # the native loops stop between layers

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
                refusal = load_refusal(self.config, self.device, self.holdings, self._model_config,
                                       [(k.layer, k.expert) for k in keys])
                if refusal is not None:
                    return refusal
                self.load_pairs([(k.layer, k.expert) for k in keys], path or self.config.checkpoint_path)
                self.placement_version = version
                return self.inventory()
            case DropExperts(placement_version=version, experts=keys):
                self.holdings.drop([(k.layer, k.expert) for k in keys], self._model_config)
                self.report_weight_bytes(self.device, self.holdings.resident_bytes(), self.holdings.stored_bytes())
                self.placement_version = version
                return self.inventory()
            case QueryInventory():
                return self.inventory()
            case AttachCudaIpc():
                return self.slot_plane.attach(message)
            case DispatchSlot():
                return self.handle_dispatch_slot(message)
            case AttachMailbox():
                model = self._model_config
                if model is None:
                    return MailboxAttached(channel_id=message.channel_id, accepted=False, reason="no experts loaded")
                threads = self._cpu_runner.num_threads if self._cpu_runner is not None else 1
                return self.mailboxes.attach(message, self.holdings, model.num_hidden_layers, model.n_routed_experts,
                                             self.swiglu_limit, self.config.route_weight_before_w2, threads)
        return ErrorReply(code=ErrorCode.UNEXPECTED, message=f"{type(message).TYPE} not handled")

    @torch.inference_mode()
    def handle_dispatch(self, dispatch: Dispatch) -> Combine | ErrorReply:
        """Dispatch -> Combine: expert compute on this worker's slots, in a fixed order.

        Host syncs on CUDA (quantized holdings): none before the reply's device->host copy for a Dispatch
        of host tensors (ZeroMQ); one read-back of ids and mask for device tensors (CUDA IPC). A malformed
        Dispatch (shapes, expert ids out of range) is logged and answered MALFORMED."""
        self.num_dispatches += 1
        if self.graphs is not None and dispatch.slot_mask is None and dispatch_shape_problem(dispatch) is None:
            replayed = self._replay(dispatch.layer, self._to_device(dispatch.hidden).to(self.dtype),
                                    self._to_device(dispatch.expert_ids).long(), self._to_device(dispatch.weights),
                                    dispatch.per_expert_outputs)
            if replayed is not None:
                return self._combine_reply(dispatch, replayed)
        selection = self._select(dispatch)
        if isinstance(selection, ErrorReply):
            return selection
        hidden = self._to_device(dispatch.hidden).to(self.dtype)  # [T, D]
        per_slot = self._selected_outputs(dispatch.layer, hidden, dispatch.weights, selection)  # [T, K, D]
        output = per_slot if dispatch.per_expert_outputs else sum_slots_in_order(per_slot)
        return self._combine_reply(dispatch, output)

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

    @torch.inference_mode()
    def handle_dispatch_slot(self, message: DispatchSlot) -> Any:
        """DispatchSlot -> CombineSlot: `handle_dispatch` on the ring's device views."""
        inputs = self.slot_plane.inputs(message)
        if isinstance(inputs, ErrorReply):
            return inputs
        hidden, ids, route_weights, mask = inputs
        if self.graphs is not None and mask is None:  # the lean path: one replay
            replayed = self._replay(message.layer, hidden, ids, route_weights, message.per_expert_outputs)
            if replayed is not None:
                self.num_dispatches += 1
                return self.slot_plane.reply(message, replayed)
        reply = self.handle_dispatch(Dispatch(
            dispatch_id=message.dispatch_id, step_id=message.step_id, layer=message.layer,
            micro_batch=message.micro_batch, hidden=hidden, expert_ids=ids, weights=route_weights,
            per_expert_outputs=message.per_expert_outputs, slot_mask=mask))
        if not isinstance(reply, Combine):
            return reply
        return self.slot_plane.reply(message, reply.output.to(hidden.dtype))

    def _replay(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor,
                per_expert_outputs: bool) -> torch.Tensor | None:
        """The captured graph's output for a Dispatch whose every slot is ours (a static output, valid
        until the next Dispatch), or None (no graph for this shape, or graphs turned off)."""
        try:
            return self.graphs.run(layer, hidden, ids, route_weights, None, per_expert_outputs)
        except RuntimeError as error:  # a capture that fails turns graphs off, never the worker
            log.warning("expert.graphs_off", name=self.config.name, reason=str(error)[:300])
            self.graphs = None
            return None

    def _select(self, dispatch: Dispatch) -> RowSelection | ErrorReply:
        """The Dispatch's selected rows (host), or the ErrorReply refusing it (MALFORMED, NOT_FOUND)."""
        problem = dispatch_shape_problem(dispatch)
        if problem is None:
            ids, mask = dispatch.expert_ids, dispatch.slot_mask
            if ids.is_cuda:  # CUDA IPC views: on this device first (ordered after the sender's signal)
                ids, mask = self._to_device(ids), None if mask is None else self._to_device(mask)
            ids, mask = routing_on_host(ids, mask)
            selection = select_rows(ids, mask, self._held_table(dispatch.layer), self._num_routed_experts())
            problem = selection if isinstance(selection, str) else None
        if problem is not None:
            log.warning("expert.dispatch_malformed", name=self.config.name, layer=dispatch.layer,
                        dispatch_id=dispatch.dispatch_id, reason=problem[:200])
            return ErrorReply(code=ErrorCode.MALFORMED, message=problem[:300])
        if selection.missing_expert_ids:
            return ErrorReply(code=ErrorCode.NOT_FOUND, message=f"{self.config.name} does not hold layer "
                              f"{dispatch.layer} experts {list(selection.missing_expert_ids)}")
        return selection

    def _num_routed_experts(self) -> int:
        if self._experts is not None:
            return self._experts.num_routed_experts
        return self._model_config.n_routed_experts if self._model_config is not None else 0

    def _held_table(self, layer: int) -> HeldTable | None:
        """The layer's host table (selection.py), rebuilt whenever what is held changes (load, drop)."""
        marker = self._experts if self._experts is not None else tuple(self.holdings.pairs)
        if self._tables_of is not marker and self._tables_of != marker:
            if self._experts is not None:
                self._tables = held_tables(self._experts)
            else:
                from moemesh.services.expert.selection import held_table

                by_layer: dict[int, list[int]] = {}
                for held_layer, expert in self.holdings.pairs:
                    by_layer.setdefault(held_layer, []).append(expert)
                self._tables = {held_layer: held_table(ids, self._num_routed_experts())
                                for held_layer, ids in by_layer.items()}
            self._tables_of = marker
        return self._tables.get(layer)

    def _slot_outputs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor,
                      selected: torch.Tensor) -> torch.Tensor:
        """Weighted output of every selected slot -> [T, K, D], zeros elsewhere (every selected expert
        must be held here; tensors on any device)."""
        selection = select_rows(*routing_on_host(ids, selected), self._held_table(layer), self._num_routed_experts())
        if isinstance(selection, str) or selection.missing_expert_ids:
            problem = selection if isinstance(selection, str) else f"experts {selection.missing_expert_ids} not held"
            raise ValueError(f"layer {layer}: {problem}")
        return self._selected_outputs(layer, hidden, route_weights, selection)

    def _selected_outputs(self, layer: int, hidden: torch.Tensor, route_weights: torch.Tensor,
                          selection: RowSelection) -> torch.Tensor:
        """hidden [T, D] on this device, route weights [T, K] (host or device), a selection without
        missing experts -> [T, K, D], zeros where not selected."""
        from moemesh.common.model.quantized import _use_kernel
        from moemesh.common.model.quantized_experts import ExpertFormat

        experts = self._experts
        num_tokens, top_k = selection.num_tokens, selection.top_k
        if selection.num_rows == 0:  # nothing of ours in this Dispatch (an empty micro-batch)
            if num_tokens:  # a Dispatch names only tokens with a slot here: this one arrived without any
                self.num_empty_selections += 1
                log.warning("expert.dispatch_without_slots", name=self.config.name, layer=layer,
                            num_tokens=num_tokens, num_empty_selections=self.num_empty_selections)
            return hidden.new_zeros(num_tokens, top_k, hidden.shape[1])
        if experts is None:  # dense holdings: rows grouped by expert, each expert once
            groups = group_by_expert(selection.expert_ids, selection.selected).moved(self._to_device)
            return slot_outputs(self.holdings.dense, layer, hidden, groups, self._to_device(route_weights).float(),
                                top_k, self.swiglu_limit, self.config.route_weight_before_w2)
        held = experts._layers[layer]
        if self.device.type == "cpu" and held.fmt is ExpertFormat.FP4:
            from moemesh.common.model.cpu_experts import expert_rows

            return expert_rows(held, hidden, selection.expert_ids, route_weights.to(self.device),
                               selection.selected, experts.swiglu_limit, experts.route_weight_before_w2,
                               self._cpu_runner)
        if not _use_kernel(experts.backend, hidden):
            return experts.per_expert_outputs(layer, hidden, self._to_device(selection.expert_ids),
                                              self._to_device(route_weights), self._to_device(selection.selected))
        # kernel path on the selected rows only (unselected slots would otherwise all run on stack index 0)
        if self._host_layout_applies(held, hidden, selection.num_rows):
            return self._grouped_rows(held, hidden, route_weights, selection)
        index = self._to_device(selection.rows)  # [3, R]: flat slot, token, stack index
        if route_weights.is_cuda:
            row_weights = route_weights.to(self.device).reshape(-1)[index[0]]  # [R]
        else:
            row_weights = self._to_device(route_weights.reshape(-1)[selection.flat_slots])  # [R]
        rows = experts._rows_kernel(held, hidden.index_select(0, index[1]), index[2][:, None],
                                    row_weights[:, None])  # [R, D] (the holder's per_expert_outputs, held check done)
        out = hidden.new_zeros(num_tokens * top_k, hidden.shape[1])
        out[index[0]] = rows.to(out.dtype)
        return out.view(num_tokens, top_k, -1)

    def _host_layout_applies(self, held, hidden: torch.Tensor, num_rows: int) -> bool:
        """Whether `_grouped_rows` computes what `QuantizedRoutedExperts._rows_kernel` would: its fused
        grouped kernels with the route weight after w2 (decode and short prefill); long FP4 prefill takes
        the holder's dequantising path and route-weight-before-w2 its two-step path."""
        from moemesh.common.kernels.fp4_prefill import use_dequant_path
        from moemesh.common.model.quantized_experts import ExpertFormat

        if self._experts.route_weight_before_w2:
            return False
        return not (held.fmt is ExpertFormat.FP4 and hidden.dtype == torch.bfloat16
                    and use_dequant_path(num_rows, len(held.expert_ids)))

    def _grouped_rows(self, held, hidden: torch.Tensor, route_weights: torch.Tensor,
                      selection: RowSelection) -> torch.Tensor:
        """`_rows_kernel`'s grouped kernels with the row layout sorted on the host (selection.sorted_layout):
        the same rows in the same order, without the device sort / searchsorted / unsort launches.
        One upload of the layout, one of the row weights (host Dispatches), no host sync -> [T, K, D]."""
        from moemesh.common.kernels.fp4_experts import grouped_experts

        num_rows = selection.num_rows
        layout = sorted_layout(selection, len(held.expert_ids))  # [2R + G + 1]
        on_device = self._to_device(torch.from_numpy(layout))
        flat_sorted, tokens_sorted = on_device[:num_rows], on_device[num_rows:2 * num_rows]  # [R] each
        offsets = on_device[2 * num_rows:].to(torch.int32)  # [G + 1]
        if route_weights.is_cuda:
            row_weights = route_weights.to(self.device).reshape(-1)[flat_sorted].float()  # [R]
        else:
            row_weights = self._to_device(route_weights.reshape(-1)[torch.from_numpy(layout[:num_rows])].float())
        stacked = held.kernel_weights()
        x_sorted = hidden.index_select(0, tokens_sorted)  # [R, D] in expert order
        y = grouped_experts(x_sorted, offsets, stacked, swiglu_limit=self._experts.swiglu_limit,
                            row_weights=row_weights)  # [R, D]
        out = hidden.new_zeros(selection.num_tokens * selection.top_k, hidden.shape[1])
        out[flat_sorted] = y.to(out.dtype)
        return out.view(selection.num_tokens, selection.top_k, -1)

    # ------------------------------------------------------------------ reports
    def num_weight_bytes(self) -> int:
        """Bytes the held experts occupy on the device (resident)."""
        return self.holdings.resident_bytes()

    def inventory(self) -> ExpertInventory:
        return expert_inventory(self.config, self.device, self.placement_version, self.holdings)

def dispatch_shape_problem(dispatch: Dispatch) -> str | None:
    """Why the Dispatch's tensor shapes disagree (from their metadata: no device work), or None."""
    ids, weights, hidden, mask = dispatch.expert_ids, dispatch.weights, dispatch.hidden, dispatch.slot_mask
    if ids.dim() != 2 or hidden.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != hidden.shape[0] or (
            mask is not None and mask.shape != ids.shape):
        return (f"dispatch shapes disagree: hidden {tuple(hidden.shape)}, ids {tuple(ids.shape)}, weights "
                f"{tuple(weights.shape)}, mask {None if mask is None else tuple(mask.shape)}")
    return None
