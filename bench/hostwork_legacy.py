"""The earlier, device-synchronising form of the per-Dispatch host work, for `bench.hostwork` only.

These are the earlier hot paths, kept here (not in the services) so that one benchmark run measures
before and after on the same machine, stage by stage, and checks that both give identical results:
- `legacy_expert_stages`: `QuantizedExpertWorker.handle_dispatch` in its earlier form — a synchronous
  host->device copy per received tensor, the held-pair check on the device (`bool(missing.any())`),
  `torch.where` over the slot mask, the holder's own held check again, the grouped kernels;
- `legacy_start_stages`: `MoEDispatcher.start` in its earlier form (ZeroMQ path) — the worker count read from
  the router (a walk over every (layer, expert) holder list), the owner lookup on the device,
  `bincount(...).tolist()`, per worker a mask and `nonzero`, device gathers, and Dispatches of device
  tensors that the channel copies to the host (synchronously below the inline size).
Each returns its result and adds the host time of every stage (µs) to `stages`.
Legend: T tokens, K top-k slots, D hidden, R selected rows, W workers.
"""

from __future__ import annotations

import time

import torch

from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.common.wire.messages import Dispatch


def _tick(stages: dict[str, float], name: str, began: float) -> float:
    now = time.perf_counter()
    stages[name] = stages.get(name, 0.0) + (now - began) * 1e6
    return now


def legacy_expert_stages(worker, dispatch: Dispatch, stages: dict[str, float]) -> torch.Tensor:
    """The old quantized worker's Dispatch -> output [T, D] (or [T, K, D]) on the worker's device."""
    from moemesh.common.model.quantized import _use_kernel
    from moemesh.common.model.quantized_experts import ExpertFormat

    began = time.perf_counter()
    device = worker.device
    hidden = dispatch.hidden.to(device).to(worker.dtype)  # [T, D] synchronous copies (no landing ring)
    ids = dispatch.expert_ids.to(device).long()  # [T, K]
    route_weights = dispatch.weights.to(device)  # [T, K]
    mask = None if dispatch.slot_mask is None else dispatch.slot_mask.to(device)  # [T, K]
    began = _tick(stages, "to_device", began)
    selected = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask
    missing = selected & ~worker._experts.held_mask(dispatch.layer, ids)
    if bool(missing.any()):
        raise KeyError(f"layer {dispatch.layer}: experts not held")
    began = _tick(stages, "held_check", began)
    experts = worker._experts
    held = experts._layers[dispatch.layer]
    if worker.device.type == "cpu" and held.fmt is ExpertFormat.FP4:
        from moemesh.common.model.cpu_experts import expert_rows

        per_slot = expert_rows(held, hidden, ids, route_weights, selected, experts.swiglu_limit,
                               experts.route_weight_before_w2, worker._cpu_runner)
        began = _tick(stages, "compute", began)
    elif not _use_kernel(experts.backend, hidden):
        per_slot = experts.per_expert_outputs(dispatch.layer, hidden, ids, route_weights, selected)
        began = _tick(stages, "compute", began)
    else:
        num_tokens, top_k = ids.shape
        (flat,) = torch.where(selected.reshape(-1))  # [R]
        began = _tick(stages, "select", began)
        rows = experts.per_expert_outputs(dispatch.layer, hidden[flat // top_k], ids.reshape(-1)[flat, None],
                                          route_weights.reshape(-1)[flat, None])  # [R, 1, D]
        out = hidden.new_zeros(num_tokens * top_k, hidden.shape[1])
        out[flat] = rows[:, 0].to(out.dtype)
        per_slot = out.view(num_tokens, top_k, -1)
        began = _tick(stages, "compute", began)
    output = per_slot if dispatch.per_expert_outputs else sum_slots_in_order(per_slot)
    _tick(stages, "sum", began)
    return output


def legacy_start_stages(dispatcher, step_id: int, layer: int, x: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor, stages: dict[str, float]) -> list[tuple[int, Dispatch]]:
    """The old ZeroMQ split of one layer (single-copy placement): sends every Dispatch through the
    dispatcher's channel and returns (worker index, Dispatch) in send order."""
    began = time.perf_counter()
    # _grow_counters: walks every holder list
    max(dispatcher.channel.num_workers, dispatcher.slot_owners.router.num_workers)
    began = _tick(stages, "counters", began)
    dispatcher.slot_owners.refresh()
    owner = dispatcher.slot_owners.owner[layer][ids]  # [T, K] on the device
    per_worker = torch.bincount(owner.reshape(-1), minlength=dispatcher.channel.num_workers).tolist()
    slot_tokens = {w: n for w, n in enumerate(per_worker) if n}
    began = _tick(stages, "owner", began)
    sent = []
    for worker_index in slot_tokens:
        mask = owner == worker_index  # [T, K]
        token_index = mask.any(dim=1).nonzero().squeeze(1)  # [T_w] (a host sync)
        slot_mask = mask[token_index]
        dispatcher._dispatch_ids += 1
        dispatch = Dispatch(
            dispatch_id=dispatcher._dispatch_ids, step_id=step_id, layer=layer, micro_batch=0,
            hidden=x[token_index].contiguous(), expert_ids=ids[token_index].to(torch.int32).contiguous(),
            weights=weights[token_index].float().contiguous(), per_expert_outputs=dispatcher.placement_invariant,
            slot_mask=slot_mask.contiguous())
        began = _tick(stages, "split", began)
        dispatcher.channel.send(worker_index, dispatch)
        began = _tick(stages, "send", began)
        sent.append((worker_index, dispatch))
    return sent
