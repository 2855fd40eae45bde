"""A GPU expert worker's mailbox loop: one CUDA graph replay per step, no message and no host work per layer.

The attention worker (CUDA, this host, this GPU) offers a mailbox whose words and regions live in its
device memory (`AttachMailbox.device_region`, mapped here through CUDA IPC) and a host segment whose
dispatch word is the step's doorbell. At attach this worker captures, for every row bucket (powers of two
up to the mailbox's rows), one CUDA graph over the layers it holds for that attention worker
(common/kernels/mailbox_gpu_worker.py has the kernels): per layer, wait for the layer's dispatch, run the
grouped expert kernels over the bucket's rows with every slot it does not own masked out (no mask on a
layer it holds whole), write the partial sum [T, D] (or, placement-invariant, the per-slot outputs
[T, K, D]) into the combine region, release the done word. Its host thread then waits on the doorbell (the native
wait of cpu_mailbox.c: spin, then back off, GIL released), writes the step's epoch into the graph's state
and replays the bucket's graph; the rows of the step decide the bucket.

The graphs read the held stacks by address: the worker keeps them referenced until it stops, and a new
routing table or placement brings a new AttachMailbox, which replaces this worker. A replay that finds
no dispatch within the timeout, or a dispatch of a later step, gives up the rest of that replay (it never
answers for a step it did not serve); the attention worker names it after its own wait times out.
Legend: T rows (a bucket), K top-k slots, D hidden, L layers, E routed experts.
"""

from __future__ import annotations

import os
import threading

import structlog
import torch

from moemesh.common.kernels.cpu_mailbox import MailboxLibrary, WaitConfig
from moemesh.common.kernels.mailbox_gpu_worker import GpuMailboxEnd, StateWord
from moemesh.common.kernels.mailbox_layout import LAYER_BITS, CombineMode, MailboxSegment, Word, WorkerState
from moemesh.common.kernels.moe_layout import sum_slots_in_order

log = structlog.get_logger("expert")

DOORBELL_POLL_S = 0.2  # how often an idle loop looks at its stop word
DOORBELL_SPIN_ENV = "MOEMESH_MAILBOX_SPIN_US"
DOORBELL_SPIN_US = 5000.0  # decode steps follow each other within a few ms: spin through the gap, sleep when idle


def doorbell_wait() -> WaitConfig:
    """How the host thread waits for the next step: spin MOEMESH_MAILBOX_SPIN_US (default 5 ms), then sleep in
    steps of 20 to 200 us. A sleeping thread wakes late by its sleep, and every step would pay it."""
    spin_us = float(os.environ.get(DOORBELL_SPIN_ENV, DOORBELL_SPIN_US))
    return WaitConfig(spin_us=spin_us, sleep_min_us=20.0, sleep_max_us=200.0)
STATE_RING = 8  # pinned state rows (a replay's row is reused 8 replays later)


def row_buckets(t_max: int) -> tuple[int, ...]:
    """Powers of two below t_max, then t_max: the graphs a worker captures."""
    buckets, size = [], 1
    while size < t_max:
        buckets.append(size)
        size *= 2
    return (*buckets, t_max)


class GpuMailboxWorker:
    """experts: the quantized holder (`QuantizedRoutedExperts`, grouped kernels); owned [L, E] bool on this
    device: the pairs this worker computes for the channel; layers: those with any owned pair, ascending."""

    def __init__(self, library: MailboxLibrary, segment: MailboxSegment, region: torch.Tensor, experts,
                 owned: torch.Tensor, layers: tuple[int, ...], timeout_s: float, wait: WaitConfig,
                 name: str = "expert") -> None:
        self.library = library
        self.segment = segment
        self.device = region.device
        self.end = GpuMailboxEnd(region, segment.layout, self.device, int(timeout_s * 1e9))
        self.experts = experts
        self.owned = owned
        self.owns_all = owned.all(dim=1).tolist()  # [L]: every expert of the layer is this worker's (no mask)
        self.layers = layers
        self.wait = wait
        self.name = name
        self.slots = segment.layout.combine is CombineMode.SLOTS
        self.held = [experts._layers[layer].kernel_weights() for layer in layers]  # what the graphs read
        self.stream = torch.cuda.Stream(self.device)
        # [R, 4] pinned: replay r's state is copied up from row r % R, never rewritten while a copy may be queued
        self.state_host = torch.zeros(STATE_RING, len(StateWord), dtype=torch.int64, pin_memory=True)
        self.buckets = row_buckets(segment.layout.t_max)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self._capture()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"gpu-mailbox-{segment.worker_index}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ per layer, captured
    def _layer_work(self, layer: int, num_rows: int) -> None:
        """The bucket's rows, whatever was posted: rows past the posted count hold an earlier post's rows (the
        region starts zeroed and takes only the gate's ids), so they compute in range and nobody reads them."""
        end = self.end
        end.take_dispatch(layer)
        ids = end.ids[:num_rows]  # [T, K] int32
        mask = None if self.owns_all[layer] else self.owned[layer][ids]  # [T, K]: the slots this worker computes
        per_slot = self.experts.per_expert_outputs(layer, end.hidden[:num_rows], ids, end.weights[:num_rows], mask,
                                                   check_held=False)  # [T, K, D]
        if self.slots:
            end.combine[:num_rows].copy_(per_slot)
        else:
            end.combine[:num_rows].copy_(sum_slots_in_order(per_slot))
        end.release_done(layer)

    def _step(self, num_rows: int) -> None:
        for layer in self.layers:
            self._layer_work(layer, num_rows)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Every bucket's graph; each is first run once with the state aborted (no wait, no release) so the
        kernels are compiled and tuned before capture."""
        aborted = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(self.stream):
            for num_rows in self.buckets:
                self.end.state.copy_(aborted)
                self._step(num_rows)
            self.stream.synchronize()
            for num_rows in self.buckets:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                    self._step(num_rows)
                self.graphs[num_rows] = graph
        self.stream.synchronize()
        self.end.served.zero_()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        segment = self.segment
        segment.set_word(Word.WORKER_PID, os.getpid())
        self.library.store_release(segment.word_address(Word.WORKER_STATE), int(WorkerState.WAITING))
        served_epoch = segment.word(Word.DISPATCH_SEQ) >> LAYER_BITS  # a doorbell rung before we came up is old
        try:
            while not self._stopped.is_set() and segment.word(Word.STOP) == 0:
                status, seen = self.library.wait(segment.word_address(Word.DISPATCH_SEQ),
                                                 (served_epoch + 1) << LAYER_BITS, DOORBELL_POLL_S, self.wait)
                if status == 1:
                    continue
                epoch = seen >> LAYER_BITS
                num_rows = segment.word(Word.NUM_ROWS)
                bucket = next((b for b in self.buckets if b >= num_rows), None)
                served_epoch = epoch
                if bucket is None or num_rows < 1:  # the attention side posts at most t_max rows
                    log.warning("expert.mailbox_bad_doorbell", name=self.name, rows=num_rows, epoch=epoch)
                    continue
                state = self.state_host[self.num_replays % STATE_RING]
                state.zero_()
                state[StateWord.EPOCH] = epoch
                with torch.cuda.stream(self.stream):
                    self.end.state.copy_(state, non_blocking=True)
                    self.graphs[bucket].replay()
                self.num_replays += 1
                segment.set_word(Word.SERVED, self.num_replays * len(self.layers))  # layers launched
        except Exception as error:  # a CUDA fault: the attention side times out and names this worker
            log.error("expert.mailbox_loop_failed", name=self.name, error=f"{type(error).__name__}: {error}"[:300])
        finally:
            self.library.store_release(segment.word_address(Word.WORKER_STATE), int(WorkerState.STOPPED))

    def stop(self) -> int:
        """Ends the loop (within DOORBELL_POLL_S) and waits for the last replay -> steps replayed."""
        self._stopped.set()
        self._thread.join()
        self.stream.synchronize()
        log.info("expert.mailbox_stopped", name=self.name, num_replays=self.num_replays,
                 layers_answered=int(self.end.served.item()))
        self.segment.close(unlink=False)
        return self.num_replays
