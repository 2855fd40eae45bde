"""The GPU waiting side of an expert mailbox: Triton kernels a CUDA graph replays with no host work.

One decode step of L layers crosses to each expert worker once per layer (docs/device-step.md has
the protocol and the segment layout). On the GPU every part of that crossing is a kernel, so the
whole step can be captured once and replayed:

- `advance_epoch`: the step's epoch lives in device memory (`epoch[0]`, int64) and this kernel adds 1
  at the start of the step, so the sequence numbers `epoch << 16 | layer` grow from replay to replay.
- `post_slot`: copies the layer's rows (hidden [T, D], ids [T, K], weights [T, K]) into the
  worker's slot, then the last block to finish stores `num_rows` and, with release semantics at
  system scope, `dispatch_seq`, and zeroes the block counter for the next post. Each block fences its
  stores at system scope first.
- `wait_done`: one warp spins on an acquire load of the worker's `done_seq` until it equals the
  posted seq, reading `%globaltimer` for the timeout. A timeout, or a done seq past the posted one,
  writes the wait-error line (code, seq, value seen, worker index) and sets the worker's word in
  `step_errors` [W] (device memory); once that word is set, later waits on the worker in the step
  return at once, so a dead worker costs one timeout per step, not one per layer.
- `read_combine`: copies the worker's combine region into a device tensor with loads that bypass
  the caches (the region is written by another agent).

- `ring_doorbell`: for a GPU worker, whose mailbox lives in this side's device memory (the worker maps it
  through CUDA IPC and runs the layers in a CUDA graph of its own, mailbox_gpu_worker.py), the step's
  first kernel also writes the row count and `epoch << 16` (release) into the host segment's dispatch
  words, so the worker's host thread learns that a step begins and which graph to replay.

Addresses: the mailbox words and regions are raw addresses the GPU can dereference — host pages
registered with `cudaHostRegister` (a CPU worker's segment, `register_host_segment`), or device
memory of this process that a GPU worker maps (`device_region`). `DeviceAddress` carries one into a kernel.

GPU only: the kernels use inline PTX (acquire/release at system scope, `%globaltimer`), which the
Triton interpreter cannot run; the CPU stand-in of the same protocol is `mailbox_driver.py`, and
`tests/test_mailbox_gpu.py` checks these kernels against it on a CUDA machine.
Legend: T rows of the layer (T <= t_max), D hidden size, K top-k, W workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moemesh.common.kernels.mailbox_layout import LAYER_BITS, MailboxError, MailboxSegment, Word

CUDA_HOST_REGISTER_MAPPED = 0x02  # cudaHostRegisterMapped
CUDA_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
DEFAULT_TIMEOUT_NS = 1_000_000_000


@dataclass(frozen=True)
class DeviceAddress:
    """A raw device-visible address handed to a Triton kernel as a pointer to `dtype`."""

    address: int
    dtype: torch.dtype = torch.int64

    def data_ptr(self) -> int:
        return self.address


# The PTX helpers take a one-element block of pointers and return one value: every thread of the warp
# executes the instruction on the same word (the loads coalesce into one), and the result is uniform.
@triton.jit
def _global_timer_ns(anchor_ptr):
    stamp = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [anchor_ptr + tl.arange(0, 1)],
                                      dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(stamp, axis=0)


@triton.jit
def _load_acquire_sys(word_ptr):
    value = tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [word_ptr + tl.arange(0, 1)],
                                      dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(value, axis=0)


@triton.jit
def _store_release_sys(word_ptr, value):
    tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                              [word_ptr + tl.arange(0, 1), value + tl.zeros([1], dtype=tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fence_sys(anchor_ptr):
    tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r,l", [anchor_ptr + tl.arange(0, 1)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_until_reached(word_ptr, target, timeout_ns, anchor_ptr):
    """Acquire-loads the word until it reaches `target` or `timeout_ns` pass -> (value seen, timed out 0/1)."""
    started = _global_timer_ns(anchor_ptr)
    seen = _load_acquire_sys(word_ptr)
    timed_out = tl.full([], 0, tl.int64)
    while (seen < target) & (timed_out == 0):
        seen = _load_acquire_sys(word_ptr)
        if seen < target:
            if _global_timer_ns(anchor_ptr) - started > timeout_ns:
                timed_out = tl.full([], 1, tl.int64)
    return seen, timed_out


@triton.jit
def _advance_epoch_kernel(epoch_ptr):
    tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


@triton.jit(do_not_specialize=["layer", "num_rows"])
def _post_rows_word_kernel(words_ptr, epoch_ptr, layer, num_rows, DISPATCH_SEQ_WORD: tl.constexpr,
                           NUM_ROWS_WORD: tl.constexpr, LAYER_SHIFT: tl.constexpr):
    # rows, then dispatch_seq = epoch << 16 | layer (release): the doorbell (layer 0, host page) or an empty post
    tl.store(words_ptr + NUM_ROWS_WORD // 8, num_rows.to(tl.int64))
    _fence_sys(epoch_ptr)
    _store_release_sys(words_ptr + DISPATCH_SEQ_WORD // 8, (tl.load(epoch_ptr) << LAYER_SHIFT) | layer)


@triton.jit(do_not_specialize=["layer", "num_rows", "hidden_size", "top_k"])
def _post_slot_kernel(hidden_ptr, ids_ptr, weights_ptr, slot_hidden_ptr, slot_ids_ptr, slot_weights_ptr,
                      words_ptr, blocks_done_ptr, epoch_ptr, layer, num_rows, hidden_size, top_k,
                      num_row_blocks: tl.constexpr, DISPATCH_SEQ_WORD: tl.constexpr, NUM_ROWS_WORD: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, LAYER_SHIFT: tl.constexpr):
    # program (row, column block): one block of one row's hidden values; column block 0 also the row's ids
    # and weights. The last program to finish (a counter zeroed before the launch) releases the flag.
    row = tl.program_id(0)
    column_block = tl.program_id(1)
    columns = column_block * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = columns < hidden_size
    values = tl.load(hidden_ptr + row * hidden_size + columns, mask=in_row)
    tl.store(slot_hidden_ptr + row * hidden_size + columns, values.to(slot_hidden_ptr.dtype.element_ty), mask=in_row)
    if column_block == 0:
        slots = tl.arange(0, BLOCK_K)
        in_k = slots < top_k
        tl.store(slot_ids_ptr + row * top_k + slots,
                 tl.load(ids_ptr + row * top_k + slots, mask=in_k).to(tl.int32), mask=in_k)
        tl.store(slot_weights_ptr + row * top_k + slots,
                 tl.load(weights_ptr + row * top_k + slots, mask=in_k).to(tl.float32), mask=in_k)
    _fence_sys(epoch_ptr)
    num_programs = num_rows * num_row_blocks
    finished = tl.atomic_add(blocks_done_ptr, 1, sem="acq_rel", scope="gpu") + 1
    if finished == num_programs:
        _fence_sys(epoch_ptr)
        seq = (tl.load(epoch_ptr) << LAYER_SHIFT) | layer
        tl.store(words_ptr + NUM_ROWS_WORD // 8, num_rows.to(tl.int64))
        _store_release_sys(words_ptr + DISPATCH_SEQ_WORD // 8, seq)
        tl.store(blocks_done_ptr, 0)  # every block has counted: the next post (any row count) starts from 0


@triton.jit(do_not_specialize=["layer", "worker_index", "timeout_ns"])
def _wait_done_kernel(words_ptr, epoch_ptr, step_errors_ptr, layer, worker_index, timeout_ns,
                      DONE_SEQ_WORD: tl.constexpr, WAIT_ERROR_WORD: tl.constexpr, LAYER_SHIFT: tl.constexpr,
                      TIMEOUT_CODE: tl.constexpr, PROTOCOL_CODE: tl.constexpr):
    # step_errors[w] holds the epoch in which worker w failed (0: none); a failed worker is not waited for
    # again in that epoch.
    epoch = tl.load(epoch_ptr)
    failed_epoch = tl.load(step_errors_ptr + worker_index, volatile=True)
    if failed_epoch != epoch:
        seq = (epoch << LAYER_SHIFT) | layer
        seen, timed_out = _spin_until_reached(words_ptr + DONE_SEQ_WORD // 8, seq, timeout_ns, epoch_ptr)
        code = timed_out * TIMEOUT_CODE
        if seen > seq:
            code = tl.full([], PROTOCOL_CODE, tl.int64)
        if code != 0:
            error_ptr = words_ptr + WAIT_ERROR_WORD // 8
            tl.store(error_ptr + 1, seq)
            tl.store(error_ptr + 2, seen)
            tl.store(error_ptr + 3, worker_index.to(tl.int64))
            tl.store(error_ptr, code)
            tl.store(step_errors_ptr + worker_index, epoch)


@triton.jit
def _read_combine_kernel(source_ptr, target_ptr, num_values, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < num_values
    tl.store(target_ptr + offsets, tl.load(source_ptr + offsets, mask=inside, cache_modifier=".cv"), mask=inside)


class GpuMailbox:
    """The waiting side's kernels for one worker's segment, bound to fixed addresses (capturable).

    `segment` is mapped on this host; its pages must be registered (`register_host_segment`) before
    the first kernel. Per layer: `post(layer, hidden, ids, weights)`, then the overlapping work, then
    `wait(layer)`, then `combine_into(out, num_rows)`. `epoch` and `step_errors` are shared by every
    mailbox of one waiting side (one step, W workers). device_region (uint8 [total_bytes] on this device):
    a GPU worker's mailbox, the same layout in device memory; the host segment is then only its doorbell
    (`ring_doorbell`) and status words."""

    def __init__(self, segment: MailboxSegment, epoch: torch.Tensor, step_errors: torch.Tensor,
                 timeout_ns: int = DEFAULT_TIMEOUT_NS, device_region: torch.Tensor | None = None) -> None:
        layout = segment.layout
        device = epoch.device
        if device.type != "cuda":
            raise ValueError(f"the GPU waiting side needs CUDA tensors, got epoch on {device}")
        self.segment = segment
        self.layout = layout
        self.epoch = epoch  # [1] int64, device
        self.step_errors = step_errors  # [W] int64, device: the epoch in which worker w failed
        self.worker_index = segment.worker_index
        self.timeout_ns = int(timeout_ns)
        hidden, ids, weights, combine, _ = layout.regions
        if device_region is not None and (device_region.device != device or device_region.dtype != torch.uint8
                                          or device_region.numel() < layout.total_bytes):
            raise ValueError(f"device mailbox region {device_region.dtype} [{device_region.numel()}] on "
                             f"{device_region.device}, expected uint8 [{layout.total_bytes}] on {device}")
        self.device_region = device_region
        self.doorbell = DeviceAddress(segment.address) if device_region is not None else None
        base = segment.address if device_region is None else device_region.data_ptr()
        hidden_dtype = torch.bfloat16 if layout.hidden_bf16 else torch.float32
        self.words = DeviceAddress(base)
        self.slot_hidden = DeviceAddress(base + hidden, hidden_dtype)
        self.slot_ids = DeviceAddress(base + ids, torch.int32)
        self.slot_weights = DeviceAddress(base + weights, torch.float32)
        self.combine = DeviceAddress(base + combine, torch.float32)
        self.blocks_done = torch.zeros(1, dtype=torch.int64, device=device)  # blocks of the current post done (0 between)
        self.block_d = min(1024, triton.next_power_of_2(layout.hidden_size))
        self.block_k = triton.next_power_of_2(max(layout.top_k, 1))

    def post(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """hidden [T, D], ids [T, K] (any integer type), weights [T, K] -> the slot, then dispatch_seq (release)."""
        num_rows, hidden_size = hidden.shape
        if not 1 <= num_rows <= self.layout.t_max or hidden_size != self.layout.hidden_size:
            raise ValueError(f"rows [{num_rows}, {hidden_size}] do not fit the slot "
                             f"[{self.layout.t_max}, {self.layout.hidden_size}]")
        column_blocks = triton.cdiv(hidden_size, self.block_d)
        _post_slot_kernel[(num_rows, column_blocks)](
            hidden.contiguous(), ids.contiguous(), weights.contiguous(), self.slot_hidden,
            self.slot_ids, self.slot_weights, self.words, self.blocks_done, self.epoch, layer, num_rows, hidden_size,
            self.layout.top_k, num_row_blocks=column_blocks, DISPATCH_SEQ_WORD=int(Word.DISPATCH_SEQ),
            NUM_ROWS_WORD=int(Word.NUM_ROWS), BLOCK_D=self.block_d, BLOCK_K=self.block_k, LAYER_SHIFT=LAYER_BITS,
            num_warps=4)

    def ring_doorbell(self, num_rows: int) -> None:
        """A GPU worker's mailbox: the host segment's dispatch word = epoch << 16 (release), its rows = num_rows."""
        self._post_rows_word(self.doorbell, 0, num_rows)

    def post_empty(self, layer: int) -> None:
        """A GPU worker's mailbox: the layer's dispatch with no rows (the layer went another way this step), so
        the worker's graph, which waits for every layer it holds, answers it with nothing and goes on."""
        self._post_rows_word(self.words, layer, 0)

    def _post_rows_word(self, words: DeviceAddress, layer: int, num_rows: int) -> None:
        _post_rows_word_kernel[(1,)](words, self.epoch, layer, num_rows, DISPATCH_SEQ_WORD=int(Word.DISPATCH_SEQ),
                                     NUM_ROWS_WORD=int(Word.NUM_ROWS), LAYER_SHIFT=LAYER_BITS, num_warps=1)

    def wait(self, layer: int) -> None:
        """Spin (one warp) until done_seq equals this layer's seq, or record why not."""
        _wait_done_kernel[(1,)](
            self.words, self.epoch, self.step_errors, layer, self.worker_index, self.timeout_ns,
            DONE_SEQ_WORD=int(Word.DONE_SEQ), WAIT_ERROR_WORD=int(Word.WAIT_ERROR), LAYER_SHIFT=LAYER_BITS,
            TIMEOUT_CODE=int(MailboxError.TIMEOUT), PROTOCOL_CODE=int(MailboxError.PROTOCOL), num_warps=1)

    def combine_into(self, out: torch.Tensor, num_rows: int) -> torch.Tensor:
        """The worker's combine rows for `num_rows` tokens ([T, D] partial or [T, K, D] slots, fp32)."""
        shape = (num_rows, *self.layout.combine_shape[1:])
        if tuple(out.shape) != shape or out.dtype != torch.float32:
            raise ValueError(f"combine target {tuple(out.shape)} {out.dtype}, expected {shape} float32")
        num_values = out.numel()
        block = 1024
        _read_combine_kernel[(triton.cdiv(num_values, block),)](self.combine, out, num_values, BLOCK=block,
                                                                 num_warps=4)
        return out


def advance_epoch(epoch: torch.Tensor) -> None:
    """epoch[0] += 1 on the device (the first kernel of a captured step)."""
    _advance_epoch_kernel[(1,)](epoch, num_warps=1)


def register_host_segment(segment: MailboxSegment) -> None:
    """Registers the segment's pages with CUDA (mapped, portable) so kernels can address them directly."""
    status = torch.cuda.cudart().cudaHostRegister(segment.address, segment.layout.total_bytes,
                                                  CUDA_HOST_REGISTER_MAPPED | CUDA_HOST_REGISTER_PORTABLE)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of mailbox {segment.path} failed with CUDA error {int(status)}")


def unregister_host_segment(segment: MailboxSegment) -> None:
    torch.cuda.cudart().cudaHostUnregister(segment.address)
