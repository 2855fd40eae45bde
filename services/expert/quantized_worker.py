"""An expert worker whose experts stay quantized (FP4/FP8 stacks), loaded from a random-weights model.

`ExpertWorker` dequantises what it reads into dense float tensors: 4 bytes per parameter on the
CPU, which for V4-Flash's CPU share (~30-40 GB of FP4) would be ~240 GB. This worker keeps the
checkpoint format (`QuantizedRoutedExperts`: ~0.53 byte per parameter) and computes
- on CUDA with 16-bit activations: the grouped Triton kernels, on the selected rows only;
- on the CPU: `cpu_experts.expert_rows` (per expert, dequantised in cache-sized row blocks).
Weights come from `random_weights.build_random_experts` (a model directory with random_weights.json);
`services.expert.main` picks this class for such a directory. The wire behaviour is ExpertWorker's:
same Dispatch/Combine, staging, partial sums or per-slot outputs, errors for experts not held.
Legend: T tokens, K top-k slots, D hidden, R selected (token, slot) rows.
"""

from __future__ import annotations

import structlog
import torch

from common.model.moe import sum_slots_in_order
from common.wire.messages import Combine, Dispatch, DropExperts, ErrorCode, ErrorReply
from services.expert.worker import ExpertWorker, ExpertWorkerConfig

log = structlog.get_logger("expert")


class QuantizedExpertWorker(ExpertWorker):
    def __init__(self, config: ExpertWorkerConfig, model_config=None) -> None:
        super().__init__(config, model_config)
        self._experts = None  # QuantizedRoutedExperts over every held pair
        self.num_empty_selections = 0  # Dispatches with tokens but no selected slot on the device (must stay 0)
        self._cpu_runner = None  # cpu_experts.CpuBlockRunner: FP4 blocks on a thread pool (CPU devices)
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

    def _to_device(self, received: torch.Tensor) -> torch.Tensor:
        """A received host tensor on this worker's device by a synchronous copy (CUDA), not through
        ExpertWorker's landing ring. Why: on the H200 runs of 2026-11-29 CUDA workers behind the ring
        saw Dispatches whose slot masks / expert ids did not match what the sender routed to them
        (empty selections; NOT_FOUND for experts owned by the other worker) at random layers. The
        cause was on the send side (staging buffers reused while ZeroMQ still held their frames, fixed in
        session 3: common/wire/tracked_send.py), not the ring; this worker stays off the ring until a run
        measures it back on (cost: one blocking copy per tensor)."""
        if received.is_cuda or self.device.type != "cuda":
            return super()._to_device(received)
        return received.to(self.device)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def handle_dispatch(self, dispatch: Dispatch) -> Combine | ErrorReply:
        """Dispatch -> Combine, as ExpertWorker.handle_dispatch, with the experts kept quantized."""
        inputs = self._dispatch_inputs(dispatch)
        if isinstance(inputs, ErrorReply):
            return inputs
        hidden, ids, route_weights, mask = inputs
        selected = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask  # [T, K]
        missing = selected & ~self._experts.held_mask(dispatch.layer, ids)
        if bool(missing.any()):
            return ErrorReply(code=ErrorCode.NOT_FOUND, message=f"{self.config.name} does not hold layer "
                              f"{dispatch.layer} experts {sorted(set(ids[missing].tolist()))}")
        per_slot = self._slot_outputs(dispatch.layer, hidden, ids, route_weights, selected)  # [T, K, D]
        output = per_slot if dispatch.per_expert_outputs else sum_slots_in_order(per_slot)
        return self._combine_reply(dispatch, output)

    def _slot_outputs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor,
                      selected: torch.Tensor) -> torch.Tensor:
        """Weighted output of every selected slot -> [T, K, D], zeros elsewhere."""
        from common.model.quantized import ExpertFormat, _use_kernel

        experts = self._experts
        held = experts._layers[layer]
        if self.device.type == "cpu" and held.fmt is ExpertFormat.FP4:
            from services.expert.cpu_experts import expert_rows

            return expert_rows(held, hidden, ids, route_weights, selected, experts.swiglu_limit,
                               experts.route_weight_before_w2, self._cpu_runner)
        if not _use_kernel(experts.backend, hidden):
            return experts.per_expert_outputs(layer, hidden, ids, route_weights, selected)
        # kernel path on the selected rows only: unselected slots would otherwise all run on stack index 0
        num_tokens, top_k = ids.shape
        (flat,) = torch.where(selected.reshape(-1))  # [R] ascending (token, slot)
        if flat.numel() == 0:  # nothing of ours in this Dispatch (an empty micro-batch)
            if num_tokens:  # a Dispatch names only tokens with a slot here: this one arrived without any
                self.num_empty_selections += 1
                log.warning("expert.dispatch_without_slots", name=self.config.name, layer=layer,
                            num_tokens=num_tokens, num_empty_selections=self.num_empty_selections)
            return hidden.new_zeros(num_tokens, top_k, hidden.shape[1])
        rows = experts.per_expert_outputs(layer, hidden[flat // top_k], ids.reshape(-1)[flat, None],
                                          route_weights.reshape(-1)[flat, None])  # [R, 1, D]
        out = hidden.new_zeros(num_tokens * top_k, hidden.shape[1])
        out[flat] = rows[:, 0].to(out.dtype)
        return out.view(num_tokens, top_k, -1)
