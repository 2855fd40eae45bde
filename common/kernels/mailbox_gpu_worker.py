"""The GPU worker side of an expert mailbox: kernels an expert worker's per-step CUDA graph replays.

A GPU expert worker on the attention worker's host serves a mailbox whose words and regions live in the
attention worker's device memory (mapped here through CUDA IPC; same GPU under MPS, or another GPU of the
host through peer access). The attention side's first kernel of a step rings a doorbell in host memory
(the host segment's dispatch word: `epoch << 16`, and its row count); the worker's host thread sees it,
writes the epoch into the graph's state and replays the graph of the smallest row bucket that holds the
rows. Per layer the worker owns, inside that graph:

- `take_dispatch`: one warp spins on an acquire load of the dispatch word until it reaches the layer's
  seq `epoch << 16 | layer`, reading `%globaltimer` for the timeout, then copies the posted row count into
  the state. A word already at a later layer of the same epoch is taken too: the attention side posted
  this layer empty (it went another way this step) and has moved on, so the pass computes rows nobody
  reads and the release of the later layer follows it in order. A timeout, or a word of a later epoch
  (the attention side gave up on this step and started another), marks the state aborted: every later
  layer of the replay skips its wait and its release, so a stale replay ends at once and never answers
  for a step it did not see;
- the expert kernels over the slot's rows (the caller's torch code: slots masked to the pairs this worker
  owns, outputs written into the combine region);
- `release_done`: unless aborted, a system-scope fence, then the done word = seq (release store).

The state is a small device tensor [4] int64: epoch (written by the host before the replay), aborted
(0 / 1), rows of the current layer, why aborted (`StateAbort`).
GPU only (inline PTX); the protocol's CPU stand-in is mailbox_driver.py.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.mailbox_gpu import DeviceAddress, _fence_sys, _spin_until_reached, _store_release_sys
from moemesh.common.kernels.mailbox_layout import LAYER_BITS, Word

STATE_WORDS = 4


class StateWord(enum.IntEnum):
    EPOCH = 0
    ABORTED = 1
    NUM_ROWS = 2
    WHY = 3


class StateAbort(enum.IntEnum):
    NONE = 0
    TIMEOUT = 1  # no dispatch for the layer within the bound
    SUPERSEDED = 2  # the dispatch word is of a later epoch


@triton.jit(do_not_specialize=["layer", "timeout_ns"])
def _take_dispatch_kernel(words_ptr, state_ptr, layer, timeout_ns, DISPATCH_SEQ_WORD: tl.constexpr,
                          NUM_ROWS_WORD: tl.constexpr, LAYER_SHIFT: tl.constexpr, TIMEOUT_CODE: tl.constexpr,
                          SUPERSEDED_CODE: tl.constexpr):
    if tl.load(state_ptr + 1, volatile=True) == 0:
        seq = (tl.load(state_ptr) << LAYER_SHIFT) | layer
        seen, timed_out = _spin_until_reached(words_ptr + DISPATCH_SEQ_WORD // 8, seq, timeout_ns, state_ptr)
        code = timed_out * TIMEOUT_CODE
        if (seen >> LAYER_SHIFT) > (seq >> LAYER_SHIFT):
            code = tl.full([], SUPERSEDED_CODE, tl.int64)
        if code != 0:
            tl.store(state_ptr + 3, code)
            tl.store(state_ptr + 2, tl.full([], 0, tl.int64))
            tl.store(state_ptr + 1, tl.full([], 1, tl.int64))
        else:
            tl.store(state_ptr + 2, tl.load(words_ptr + NUM_ROWS_WORD // 8, volatile=True))


@triton.jit(do_not_specialize=["layer"])
def _release_done_kernel(words_ptr, state_ptr, served_ptr, layer, DONE_SEQ_WORD: tl.constexpr,
                         LAYER_SHIFT: tl.constexpr):
    if tl.load(state_ptr + 1, volatile=True) == 0:
        seq = (tl.load(state_ptr) << LAYER_SHIFT) | layer
        tl.store(served_ptr, tl.load(served_ptr) + 1)
        _fence_sys(state_ptr)
        _store_release_sys(words_ptr + DONE_SEQ_WORD // 8, seq)


class GpuMailboxEnd:
    """The worker's end of one device mailbox: the mapped region (uint8 [total_bytes] on the attention
    worker's device, or a peer's), tensor views of its slot and combine regions, the replay state.

    Views: hidden [t_max, D] (bf16 or fp32), ids [t_max, K] int32, weights [t_max, K] fp32, combine
    [t_max, D] or [t_max, K, D] fp32. `state` [4] int64 and `served` [1] int64 live on `device`."""

    def __init__(self, region: torch.Tensor, layout, device: torch.device, timeout_ns: int) -> None:
        if region.dtype != torch.uint8 or region.numel() < layout.total_bytes:
            raise ValueError(f"device mailbox region of {region.numel()} bytes, the layout needs {layout.total_bytes}")
        self.region = region  # keeps the mapping alive
        self.layout = layout
        hidden, ids, weights, combine, _ = layout.regions
        t_max, top_k, dim = layout.t_max, layout.top_k, layout.hidden_size
        hidden_dtype = torch.bfloat16 if layout.hidden_bf16 else torch.float32
        hidden_bytes = t_max * dim * (2 if layout.hidden_bf16 else 4)
        self.hidden = region[hidden:hidden + hidden_bytes].view(hidden_dtype).view(t_max, dim)
        self.ids = region[ids:ids + t_max * top_k * 4].view(torch.int32).view(t_max, top_k)
        self.weights = region[weights:weights + t_max * top_k * 4].view(torch.float32).view(t_max, top_k)
        num_combine = 1
        for size in layout.combine_shape:
            num_combine *= size
        self.combine = region[combine:combine + num_combine * 4].view(torch.float32).view(layout.combine_shape)
        self.words = DeviceAddress(region.data_ptr())
        self.device = torch.device(device)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=self.device)  # [4]
        self.served = torch.zeros(1, dtype=torch.int64, device=self.device)  # layers answered, all replays
        self.timeout_ns = int(timeout_ns)

    def take_dispatch(self, layer: int) -> None:
        """Wait (one warp, bounded) for the layer's dispatch of the state's epoch; the rows into the state."""
        _take_dispatch_kernel[(1,)](
            self.words, self.state, layer, self.timeout_ns, DISPATCH_SEQ_WORD=int(Word.DISPATCH_SEQ),
            NUM_ROWS_WORD=int(Word.NUM_ROWS), LAYER_SHIFT=LAYER_BITS, TIMEOUT_CODE=int(StateAbort.TIMEOUT),
            SUPERSEDED_CODE=int(StateAbort.SUPERSEDED), num_warps=1)

    def release_done(self, layer: int) -> None:
        """The layer's answer is in the combine region: done word = seq (release), unless aborted."""
        _release_done_kernel[(1,)](self.words, self.state, self.served, layer, DONE_SEQ_WORD=int(Word.DONE_SEQ),
                                   LAYER_SHIFT=LAYER_BITS, num_warps=1)
