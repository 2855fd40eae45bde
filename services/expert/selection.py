"""Which (token, slot) rows of one Dispatch a quantized expert worker computes, decided on the host.

A Dispatch over ZeroMQ arrives as host tensors, so its expert ids and slot mask are read where they
already are: the range check, the held-pair check and the row selection cost no device
synchronisation and no kernel launch (doing them on the device with `bool(missing.any())` and
`torch.where` would cost two host syncs per Dispatch, plus a third inside the holder for a layer held in part). A
DispatchSlot (CUDA IPC) carries device views; the worker reads its ids and mask back in one transfer
(`routing_on_host`: the one sync of such a Dispatch) and selects the same way.

`HeldTable` is the host copy of one layer's held experts (built once per placement from the
holder's expert ids, `held_tables`): which global ids are held and each one's stack index.
Invariants of a `RowSelection`: `rows` [3, R] holds `flat_slots` (ascending, token-major t·K + k: the
order the device path used), `row_tokens = flat_slots // K` and `row_local` (the stack index of each
row's expert), in one tensor so that the worker uploads it in one copy; rows are exactly the selected
slots, all of them held (`missing_expert_ids` empty) when the worker computes.
Legend: T tokens, K top-k slots, R selected rows, E routed experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class HeldTable:
    """One layer's held experts on the host: held [E] bool, local [E] int64 stack index (0 where not held)."""

    held: torch.Tensor
    local: torch.Tensor


def held_table(expert_ids: Iterable[int], num_experts: int) -> HeldTable:
    """expert ids held (ascending, as the holder stacks them) -> the layer's host table."""
    ids = torch.tensor(sorted(int(e) for e in expert_ids), dtype=torch.int64)
    held = torch.zeros(num_experts, dtype=torch.bool)
    local = torch.zeros(num_experts, dtype=torch.int64)
    held[ids] = True
    local[ids] = torch.arange(ids.numel(), dtype=torch.int64)
    return HeldTable(held, local)


def held_tables(experts) -> dict[int, HeldTable]:
    """{layer: HeldTable} of a `QuantizedRoutedExperts` (its `_layers[layer].expert_ids`)."""
    return {layer: held_table(held.expert_ids, experts.num_routed_experts) for layer, held in experts._layers.items()}


@dataclass(frozen=True)
class RowSelection:
    """The selected rows of a [T, K] Dispatch (host tensors; see the module docstring)."""

    num_tokens: int
    top_k: int
    expert_ids: torch.Tensor  # [T, K] int64
    rows: torch.Tensor  # [3, R] int64: flat slot t·K + k (ascending), token t, stack index of the slot's expert
    selected: torch.Tensor  # [T, K] bool
    missing_expert_ids: tuple[int, ...]  # selected experts this worker does not hold, ascending

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[1])

    @property
    def flat_slots(self) -> torch.Tensor:  # [R]
        return self.rows[0]

    @property
    def row_tokens(self) -> torch.Tensor:  # [R]
        return self.rows[1]

    @property
    def row_local(self) -> torch.Tensor:  # [R] (meaningful only when nothing is missing)
        return self.rows[2]


def routing_on_host(ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [T, K] int, mask [T, K] bool or None -> (ids int64, mask) on the host; device tensors are
    read back together in one transfer (one sync), host tensors are used as they are."""
    if not ids.is_cuda and (mask is None or not mask.is_cuda):
        return ids.long(), mask
    top_k = ids.shape[1]
    packed = ids.long() if mask is None else torch.cat([ids.long(), mask.to(ids.device).long()], dim=1)  # [T, K|2K]
    host = packed.cpu()
    return host[:, :top_k], (None if mask is None else host[:, top_k:].bool())


def select_rows(ids: torch.Tensor, mask: torch.Tensor | None, table: HeldTable | None,
                num_experts: int) -> RowSelection | str:
    """ids [T, K] int64 host, mask [T, K] bool host or None (every slot), the layer's table (None:
    nothing held) -> the selection, or why the Dispatch is malformed (an id outside 0..E-1).
    numpy on the host: a handful of [T, K] operations cost ~1 µs each there, torch's ~3-5 µs."""
    num_tokens, top_k = ids.shape
    ids_np = ids.numpy()
    if ids_np.size and (int(ids_np.min()) < 0 or int(ids_np.max()) >= num_experts):
        return f"expert ids outside 0..{num_experts - 1}: min {int(ids_np.min())}, max {int(ids_np.max())}"
    selected = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()  # [T, K]
    flat_slots = np.flatnonzero(selected.numpy())  # [R] ascending
    row_ids = ids_np.reshape(-1)[flat_slots]  # [R]
    if table is None:
        missing = tuple(sorted(set(row_ids.tolist())))
        row_local = np.zeros_like(row_ids)
    else:
        absent = ~table.held.numpy()[row_ids]  # [R]
        missing = tuple(sorted(set(row_ids[absent].tolist()))) if absent.any() else ()
        row_local = table.local.numpy()[row_ids]
    rows = np.stack([flat_slots, flat_slots // top_k, row_local]).astype(np.int64, copy=False)  # [3, R]
    return RowSelection(num_tokens, top_k, ids, torch.from_numpy(rows), selected, missing)


def sorted_layout(selection: RowSelection, num_held: int) -> np.ndarray:
    """The grouped kernels' row layout, computed on the host: [2R + G + 1] int64 = flat slots in expert
    order, their tokens in expert order, then the expert offsets [G + 1] (rows of stack index g are
    offsets[g] ..< offsets[g+1]). The order is the stable sort by stack index that
    `quantized.layout_by_expert` computes on the device, so the kernels see the same rows in the same order.
    G: experts held in the layer."""
    rows = selection.rows.numpy()  # [3, R]
    order = np.argsort(rows[2], kind="stable")  # [R]
    offsets = np.searchsorted(rows[2][order], np.arange(num_held + 1))  # [G + 1], rows < g before g
    return np.concatenate([rows[0][order], rows[1][order], offsets]).astype(np.int64, copy=False)
