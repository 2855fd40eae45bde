"""The waiting side of the CPU expert mailbox, as a CPU stand-in for what the GPU does inside its graph.

Per layer, for every worker in index order: write the dispatch slot (hidden rows, top-k ids and
weights, T), then release dispatch_seq = (epoch, layer). Then for every worker in index order: wait
for done_seq == that seq with a timeout (spin, then back off; the wait runs in C, GIL released);
read the worker's error word; combine the shares in worker order (partial sums) or take each slot
from its owner and add the K slots in slot order (per-slot mode). The owner table [L, E] names the
worker of every (layer, expert); nothing is split here, each worker picks its pairs from it.

A wait that times out writes the wait-error line of that worker's segment (TIMEOUT, seq, the done
seq it saw, worker index) instead of hanging; later waits on that worker in the same step return at
once (as the GPU's spin kernels do once an error word is set), the step runs to its end, and the
caller reads `StepResult.failures` after it. Recovery is the caller's: re-run the step (a new epoch)
with the failed worker replaced by a `LocalShare`, e.g. `InProcessShare`, which computes that
worker's share in this process with the same FP4 kernel, so the result is the exact one.
Legend: T rows, K top-k slots, D hidden, L layers, E routed experts, W workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog
import torch

from moemesh.common.kernels.cpu_fp4 import ExpertStacks, NativeFp4
from moemesh.common.kernels.cpu_mailbox import ExpertMath, MailboxLibrary, WaitConfig
from moemesh.common.kernels.mailbox_layout import (CombineMode, MailboxError, MailboxLayout, MailboxSegment, Word,
                                           WorkerState, make_seq, split_seq)
from moemesh.common.kernels.moe_layout import sum_slots_in_order

log = structlog.get_logger("mailbox")


@dataclass(frozen=True)
class WorkerFailure:
    """One worker's failure in a step, as its error words say."""

    worker_index: int
    layer: int
    seq: int
    code: MailboxError
    detail: int  # TIMEOUT: the done seq seen; worker errors: the worker's detail word

    def describe(self) -> str:
        return f"expert worker {self.worker_index}: {self.code.name} at layer {self.layer} (seq {self.seq:#x}, " \
               f"detail {self.detail})"


@dataclass
class StepResult:
    hidden: torch.Tensor  # [T, D] after the last layer
    routed: list[torch.Tensor] = field(default_factory=list)  # per layer [T, D]
    failures: list[WorkerFailure] = field(default_factory=list)
    epoch: int = 0

    @property
    def failed_workers(self) -> set[int]:
        return {failure.worker_index for failure in self.failures}


class LocalShare(Protocol):
    """A worker's share computed in this process: (layer, hidden [T, D], ids [T, K], weights [T, K])
    -> [T, D] partial sums or [T, K, D] per-slot outputs (the mailbox's combine format)."""

    def __call__(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ...


RouteFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (layer, h [T, D]) -> ids, weights


class MailboxDriver:
    """Drives W mailboxes (segment i belongs to worker i) through decode steps of L layers."""

    def __init__(self, library: MailboxLibrary, segments: Sequence[MailboxSegment], owner: torch.Tensor,
                 timeout_s: float = 2.0, wait: WaitConfig = WaitConfig(), first_epoch: int = 1) -> None:
        layouts = {segment.layout for segment in segments}
        if len(layouts) != 1:
            raise ValueError(f"every mailbox of a driver needs one layout, got {layouts}")
        self.layout: MailboxLayout = layouts.pop()
        if owner.dim() != 2 or int(owner.min()) < 0 or int(owner.max()) >= len(segments):
            raise ValueError(f"owner table {tuple(owner.shape)} must name workers 0..{len(segments) - 1}")
        for index, segment in enumerate(segments):
            if segment.worker_index != index:
                raise ValueError(f"segment {segment.path} is for worker {segment.worker_index}, not {index}")
        self.library = library
        self.segments = list(segments)
        self.owner = owner.to(torch.int64).contiguous()  # [L, E]
        self.timeout_s = timeout_s
        self.wait_config = wait
        # the last epoch used: past every seq these segments have carried, so seqs keep growing per segment
        # across drivers (a new driver on old segments never posts a seq a worker already answered)
        carried = max(max(segment.word(Word.DISPATCH_SEQ), segment.word(Word.DONE_SEQ)) for segment in segments)
        self.epoch = max(first_epoch - 1, split_seq(carried)[0])

    @property
    def num_layers(self) -> int:
        return self.owner.shape[0]

    def run_step(self, hidden: torch.Tensor, route: RouteFn, replacements: Mapping[int, LocalShare] | None = None,
                 ) -> StepResult:
        """One decode step over every layer: h <- h + routed(h) per layer, routing from `route`.
        Workers in `replacements` are not dispatched to; their share comes from the LocalShare."""
        replacements = replacements or {}
        self.epoch += 1
        result = StepResult(hidden, epoch=self.epoch)
        failed: set[int] = set()
        for layer in range(self.num_layers):
            ids, weights = route(layer, result.hidden)
            routed = self.run_layer(layer, result.hidden, ids, weights, replacements, failed, result.failures)
            result.routed.append(routed)
            result.hidden = result.hidden + routed
        if result.failures:
            log.warning("mailbox.step_failed", epoch=self.epoch,
                        failures=[failure.describe() for failure in result.failures])
        return result

    def run_layer(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  replacements: Mapping[int, LocalShare], failed: set[int], failures: list[WorkerFailure],
                  ) -> torch.Tensor:
        """Dispatch, wait, combine for one layer -> routed [T, D] fp32 (meaningless where a worker failed:
        the step's failures say so)."""
        num_rows = hidden.shape[0]
        if num_rows > self.layout.t_max or ids.shape != (num_rows, self.layout.top_k):
            raise ValueError(f"{num_rows} rows / ids {tuple(ids.shape)} do not fit the mailbox "
                             f"(t_max {self.layout.t_max}, top_k {self.layout.top_k})")
        seq = make_seq(self.epoch, layer)
        remote = [i for i in range(len(self.segments)) if i not in replacements]
        for index in remote:
            self.write_slot(self.segments[index], hidden, ids, weights)
            self.library.post(self.segments[index], seq, num_rows)
        shares: dict[int, torch.Tensor] = {}
        for index, share_fn in sorted(replacements.items()):  # overlaps the remote workers' compute
            shares[index] = share_fn(layer, hidden, ids, weights)
        for index in remote:  # ascending worker index
            if index in failed:  # an earlier layer of this step failed: do not wait again
                continue
            failure = self.await_worker(index, layer, seq)
            if failure is not None:
                failed.add(index)
                failures.append(failure)
                continue
            shares[index] = torch.from_numpy(self.segments[index].combine[:num_rows]).clone()
        return self.combine(layer, ids, shares, num_rows, hidden.shape[1])

    def combine(self, layer: int, ids: torch.Tensor, shares: Mapping[int, torch.Tensor], num_rows: int,
                hidden_size: int) -> torch.Tensor:
        """The shares in worker order -> routed [T, D] fp32 (a missing share counts as zeros)."""
        if self.layout.combine is CombineMode.PARTIAL:
            routed = torch.zeros(num_rows, hidden_size)
            for index in sorted(shares):
                routed += shares[index]
            return routed
        slot_owner = self.owner[layer][ids.to(torch.int64)]  # [T, K]
        per_slot = torch.zeros(num_rows, self.layout.top_k, hidden_size)  # [T, K, D]
        for index in sorted(shares):
            per_slot = torch.where((slot_owner == index)[..., None], shares[index], per_slot)
        return sum_slots_in_order(per_slot)

    def write_slot(self, segment: MailboxSegment, hidden: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> None:
        num_rows = hidden.shape[0]
        if self.layout.hidden_bf16:
            segment.hidden[:num_rows] = hidden.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        else:
            segment.hidden[:num_rows] = hidden.to(torch.float32).numpy()
        segment.ids[:num_rows] = ids.to(torch.int32).numpy()
        segment.weights[:num_rows] = weights.to(torch.float32).numpy()

    def await_worker(self, index: int, layer: int, seq: int) -> WorkerFailure | None:
        """Waits for worker `index` to complete `seq`; a failure (timeout, or the worker's error word)."""
        segment = self.segments[index]
        status, seen = self.library.wait(segment.word_address(Word.DONE_SEQ), seq, self.timeout_s, self.wait_config)
        if status != 0:
            code = MailboxError.TIMEOUT if status == 1 else MailboxError.PROTOCOL
            segment.set_word(Word.WAIT_ERROR_SEQ, seq)
            segment.set_word(Word.WAIT_ERROR_SEEN, seen)
            segment.set_word(Word.WAIT_ERROR_WORKER, index)
            segment.set_word(Word.WAIT_ERROR, int(code))
            return WorkerFailure(index, layer, seq, code, seen)
        if segment.word(Word.WORKER_ERROR_SEQ) == seq:  # written before the done release: visible now
            return WorkerFailure(index, layer, seq, MailboxError(segment.word(Word.WORKER_ERROR)),
                                 segment.word(Word.WORKER_ERROR_DETAIL))
        return None


def read_wait_error(segment: MailboxSegment) -> WorkerFailure | None:
    """The last wait-error line the waiting side wrote into `segment` (None if none)."""
    code = segment.word(Word.WAIT_ERROR)
    if code == MailboxError.OK:
        return None
    seq = segment.word(Word.WAIT_ERROR_SEQ)
    return WorkerFailure(segment.word(Word.WAIT_ERROR_WORKER), split_seq(seq)[1], seq, MailboxError(code),
                         segment.word(Word.WAIT_ERROR_SEEN))


class InProcessShare:
    """A worker's share computed in this process with the FP4 kernel the worker runs (the same
    library, so the same machine code): the failover stand-in, and in-process experts.

    stacks / local as `MailboxWorker` takes them; combine: the mailbox's format."""

    def __init__(self, kernel: NativeFp4, stacks: Sequence[ExpertStacks | None], local: torch.Tensor,
                 math: ExpertMath, combine: CombineMode, num_threads: int = 1) -> None:
        self.kernel = kernel
        self.stacks = list(stacks)
        self.local = local.to(torch.int64).contiguous()
        self.math = math
        self.combine = combine
        self.num_threads = num_threads

    def __call__(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_rows, top_k = ids.shape
        local = self.local[layer]
        mask = local[ids.to(torch.int64)] >= 0  # [T, K]
        out = torch.zeros(num_rows * top_k, hidden.shape[1])  # [T·K, D]
        if bool(mask.any()):
            self.kernel.routed_experts(hidden, ids, weights, mask, local, self.stacks[layer], self.math.swiglu_limit,
                                       self.math.route_before_w2, out, self.num_threads)
        per_slot = out.view(num_rows, top_k, -1)
        if self.combine is CombineMode.SLOTS:
            return per_slot
        partial = torch.zeros(num_rows, hidden.shape[1])  # 0 + owned slots in slot order, as the worker adds
        for slot in range(top_k):
            partial += torch.where(mask[:, slot, None], per_slot[:, slot], 0.0)
        return partial


def wait_until_attached(segment: MailboxSegment, pid: int | None, timeout_s: float) -> None:
    """Waits for a worker (of `pid` if given) to attach to `segment` and wait for dispatches."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = segment.word(Word.WORKER_STATE)
        if state in (WorkerState.WAITING, WorkerState.COMPUTING) and pid in (None, segment.word(Word.WORKER_PID)):
            return
        time.sleep(0.005)
    raise TimeoutError(f"no mailbox worker attached to {segment.path} within {timeout_s} s")
