"""An expert worker whose experts stay quantized (FP4/FP8 stacks), loaded from a random-weights model.

`ExpertWorker` dequantises what it reads into dense float tensors: 4 bytes per parameter on the
CPU, which for V4-Flash's CPU share (~30-40 GB of FP4) would be ~240 GB. This worker keeps the
checkpoint format (`QuantizedRoutedExperts`: ~0.53 byte per parameter) and computes
- on CUDA with 16-bit activations: the grouped Triton kernels, on the selected rows only;
- on the CPU: `cpu_experts.expert_rows` (per expert, dequantised in cache-sized row blocks).
Weights come from `random_weights.build_random_experts` (a model directory with random_weights.json);
`services.expert.main` picks this class for such a directory. The wire behaviour is ExpertWorker's:
same Dispatch/Combine, staging, partial sums or per-slot outputs, errors for experts not held.
Host work per Dispatch (issue 10): the held-pair check, the row selection and the grouped kernels' row
layout (sort by expert, offsets) run on the host from the received ids and mask (selection.py; host
tables built once per placement), and the tensors go up through `ExpertWorker`'s landing ring (pinned,
asynchronous): no host sync before the reply's copy, ~10 fewer launches than the device-side layout.
The worker was kept off the ring after the H200 runs of 2026-11-29 saw corrupted slot masks; the cause
was on the send side (staging buffers reused while ZeroMQ still held their frames, fixed in session 3:
common/wire/tracked_send.py), and the full-size pair check / refusal records (bench/fullsize_verify.py)
are what would show a regression.
Legend: T tokens, K top-k slots, D hidden, R selected (token, slot) rows.
"""

from __future__ import annotations

import structlog
import torch

from common.model.moe import sum_slots_in_order
from common.wire.messages import Combine, Dispatch, DropExperts, ErrorCode, ErrorReply
from services.expert.selection import (
    HeldTable, RowSelection, held_tables, routing_on_host, select_rows, sorted_layout,
)
from services.expert.worker import ExpertWorker, ExpertWorkerConfig

log = structlog.get_logger("expert")


class QuantizedExpertWorker(ExpertWorker):
    # Received host tensors go up by plain copies, not through the landing ring: with the ring
    # (several small tensors per Dispatch) the two-GPU ZeroMQ run at B = 64 took 12 ms per Dispatch
    # in these workers (session 4, call 4; 2.6 ms without it); the cause in the ring is not identified.
    uses_landing_ring = False

    def __init__(self, config: ExpertWorkerConfig, model_config=None) -> None:
        super().__init__(config, model_config)
        self._experts = None  # QuantizedRoutedExperts over every held pair
        self.num_empty_selections = 0  # Dispatches with tokens but no selected slot on the device (must stay 0)
        self._cpu_runner = None  # cpu_experts.CpuBlockRunner: FP4 blocks on a thread pool (CPU devices)
        self._tables: dict[int, HeldTable] = {}  # host held/stack-index tables per layer (selection.py)
        self._tables_of = None  # the holder they were built from
        # self._weights keeps ExpertWorker's meaning "held pairs" (keys); values are () here

    # ------------------------------------------------------------------ loading
    def load_pairs(self, pairs, checkpoint_path: str) -> None:
        from common.model.config import ModelConfig
        from services.expert.random_weights import build_random_experts, read_random_spec

        spec = read_random_spec(checkpoint_path)
        if self._model_config is None:
            self._model_config = ModelConfig.load(checkpoint_path)
        held = sorted(set(self._weights) | {(int(l), int(e)) for l, e in pairs})
        self._rebuild(held, checkpoint_path, spec)  # the CPU fill uses torch's threads
        if self.device.type == "cpu" and self._cpu_runner is None:
            from services.expert.cpu_experts import CpuBlockRunner

            # parallel over FP4 blocks on Python threads, each torch op single-threaded (see CpuBlockRunner)
            self._cpu_runner = CpuBlockRunner(torch.get_num_threads())
            torch.set_num_threads(1)
        log.info("expert.loaded", name=self.config.name, num_pairs=len(held), device=str(self.device),
                 num_weight_bytes=self.num_weight_bytes(), source="random", expert_fill=spec.expert_fill.value)

    def _rebuild(self, held: list[tuple[int, int]], checkpoint_path: str, spec) -> None:
        """Regenerate every held pair (deterministic per layer, so a pair's bytes never change)."""
        from services.expert.random_weights import build_random_experts

        self._experts = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._experts = build_random_experts(self._model_config, held, self.device, spec,
                                             route_weight_before_w2=self.config.route_weight_before_w2)
        self._weights = {pair: () for pair in held}
        self._checkpoint_path = checkpoint_path

    async def handle(self, message):
        if isinstance(message, DropExperts):
            from services.expert.random_weights import read_random_spec

            drop = {(k.layer, k.expert) for k in message.experts}
            held = sorted(set(self._weights) - drop)
            self._rebuild(held, self._checkpoint_path, read_random_spec(self._checkpoint_path))
            self.placement_version = message.placement_version
            return self.inventory()
        return await super().handle(message)

    def num_weight_bytes(self) -> int:
        if self._experts is None:
            return 0
        return sum(t.numel() * t.element_size() for held in self._experts._layers.values()
                   for t in (held.w1, held.s1, held.w2, held.s2, held.w3, held.s3))

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def handle_dispatch(self, dispatch: Dispatch) -> Combine | ErrorReply:
        """Dispatch -> Combine, as ExpertWorker.handle_dispatch, with the experts kept quantized.

        Host syncs on CUDA: no stream synchronise before the reply's device->host copy for a Dispatch of
        host tensors (ZeroMQ; their uploads are plain copies: no landing ring); one read-back of ids and
        mask for device tensors (CUDA IPC). Checks and row selection run on the host (selection.py).
        A malformed Dispatch (shapes, expert ids out of range) is logged and answered MALFORMED."""
        self.num_dispatches += 1
        selection = self._select(dispatch)
        if isinstance(selection, ErrorReply):
            return selection
        hidden = self._to_device(dispatch.hidden).to(self.dtype)  # [T, D]
        per_slot = self._selected_outputs(dispatch.layer, hidden, dispatch.weights, selection)  # [T, K, D]
        output = per_slot if dispatch.per_expert_outputs else sum_slots_in_order(per_slot)
        return self._combine_reply(dispatch, output)

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
        """The layer's host table (selection.py), rebuilt whenever the holder object changes (load, drop)."""
        if self._tables_of is not self._experts:
            self._tables = {} if self._experts is None else held_tables(self._experts)
            self._tables_of = self._experts
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
        from common.model.quantized import ExpertFormat, _use_kernel

        experts = self._experts
        num_tokens, top_k = selection.num_tokens, selection.top_k
        if selection.num_rows == 0:  # nothing of ours in this Dispatch (an empty micro-batch)
            if num_tokens:  # a Dispatch names only tokens with a slot here: this one arrived without any
                self.num_empty_selections += 1
                log.warning("expert.dispatch_without_slots", name=self.config.name, layer=layer,
                            num_tokens=num_tokens, num_empty_selections=self.num_empty_selections)
            return hidden.new_zeros(num_tokens, top_k, hidden.shape[1])
        held = experts._layers[layer]
        if self.device.type == "cpu" and held.fmt is ExpertFormat.FP4:
            from services.expert.cpu_experts import expert_rows

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
        from common.kernels.fp4_prefill import use_dequant_path
        from common.model.quantized import ExpertFormat

        if self._experts.route_weight_before_w2:
            return False
        return not (held.fmt is ExpertFormat.FP4 and hidden.dtype == torch.bfloat16
                    and use_dequant_path(num_rows, len(held.expert_ids)))

    def _grouped_rows(self, held, hidden: torch.Tensor, route_weights: torch.Tensor,
                      selection: RowSelection) -> torch.Tensor:
        """`_rows_kernel`'s grouped kernels with the row layout sorted on the host (selection.sorted_layout):
        the same rows in the same order, without the device sort / searchsorted / unsort launches.
        One upload of the layout, one of the row weights (host Dispatches), no host sync -> [T, K, D]."""
        from common.kernels.fp4_experts import grouped_down, grouped_gate_up

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
        h = grouped_gate_up(x_sorted, offsets, stacked, swiglu_limit=self._experts.swiglu_limit)  # [R, I]
        y = grouped_down(h, offsets, stacked, row_weights=row_weights)  # [R, D]
        out = hidden.new_zeros(selection.num_tokens * selection.top_k, hidden.shape[1])
        out[flat_sorted] = y.to(out.dtype)
        return out.view(selection.num_tokens, selection.top_k, -1)


def dispatch_shape_problem(dispatch: Dispatch) -> str | None:
    """Why the Dispatch's tensor shapes disagree (from their metadata: no device work), or None."""
    ids, weights, hidden, mask = dispatch.expert_ids, dispatch.weights, dispatch.hidden, dispatch.slot_mask
    if ids.dim() != 2 or hidden.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != hidden.shape[0] or (
            mask is not None and mask.shape != ids.shape):
        return (f"dispatch shapes disagree: hidden {tuple(hidden.shape)}, ids {tuple(ids.shape)}, weights "
                f"{tuple(weights.shape)}, mask {None if mask is None else tuple(mask.shape)}")
    return None
