"""The host-memory mailbox side of `MoEDispatcher`: CPU expert workers on this host, no message per layer.

With `data_plane = "mailbox"` the dispatcher offers each expert worker, the first time a layer it holds
runs, a mailbox (docs/device-step.md: one shared segment per attention/expert pair, a dispatch word the
attention worker releases, a done word the worker releases, each a sequence number `epoch << 16 |
layer`). The offer (`AttachMailbox`, ZeroMQ, once per routing table) names the pairs the worker computes
for this attention worker: its share of the owner table on layers without replicas. A worker that
accepts runs a native loop that waits on the segment (services/expert/mailbox_plane.py); one that
refuses (another host, a GPU worker, experts not in FP4) is remembered and stays on ZeroMQ
(`attention.data_plane_fallback`, logged once per worker). On a CUDA attention worker the offer also carries
a device region with the same layout (CUDA IPC): a GPU expert worker on this GPU takes it instead
(services/expert/gpu_mailbox.py, one CUDA graph replay per step) and answers `on_device`; the host segment
then only carries the step's doorbell (rung by the step's first kernel, so its host thread replays the
graph of the step's row bucket) and the worker's status words.

Per layer (`post`, then `collect`): the whole micro-batch's hidden rows, top-k ids and route weights are
written into the segment and the dispatch word released; the worker computes the slots of the pairs it
owns (nothing is split or counted on the attention side) and releases the done word; `collect` waits for
it, bounded by `timeout_s`, and reads the partial sum [T, D] (or, placement-invariant, the per-slot
outputs [T, K, D]). A wait that times out, or a worker's error word, writes the segment's wait-error line
and raises the dispatcher's `ExpertWorkerLost` (built by `on_lost`), so recovery rolls the step back and
retries on a replica or a restarted worker; the lost worker's mailbox is dropped and offered again when it
is used next. Two waiting sides, one protocol:
- attention worker on the CPU: the host thread writes the rows, releases the word and waits (spinning
  briefly, then backing off); a failure raises at once from `collect`;
- attention worker on CUDA: every part is a kernel (`common/kernels/mailbox_gpu.py`: the segment's pages
  registered with CUDA, the step's epoch a device word advanced by the first kernel of the step, the
  post, a spin-wait with a timeout, the combine read), so the host neither writes nor waits per layer
  and a whole step can be one CUDA graph (graph_decode.py). A wait that fails records the epoch in
  `step_errors` [W] on the device; `confirm` reads it once at the end of the step and raises then.
  A GPU worker's graph waits for every layer it holds: a layer that goes another way in a step rung for
  it (`skip`) gets an empty post, so the graph answers it with nothing and goes on.
A mailbox holds one layer of one micro-batch at a time: the worker configuration refuses it with more
than one micro-batch. A micro-batch with more rows than a mailbox (`max_tokens`: long prefill chunks)
goes over ZeroMQ.
Legend: T tokens, K top-k slots, D hidden, L layers, E routed experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from moemesh.common.kernels.cpu_mailbox import WaitConfig
from moemesh.common.kernels.mailbox_layout import (
    CONTROL_BYTES, LAYER_BITS, CombineMode, MailboxError, MailboxLayout, MailboxSegment, Word, make_seq,
)
from moemesh.common.wire.cuda_ipc import host_identity
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.messages import AttachMailbox, MailboxAttached

log = structlog.get_logger("attention")


@dataclass(frozen=True)
class MailboxConfig:
    """max_tokens: rows a mailbox carries (a larger micro-batch goes over ZeroMQ); timeout_s: how long a
    layer waits for a worker before it counts as lost; attach_timeout_s: for the offer and the worker
    loop to come up (a CPU worker may build its native library first, a GPU worker captures a graph per
    row bucket, compiling its kernels the first time)."""

    max_tokens: int = 256
    timeout_s: float = 2.0
    attach_timeout_s: float = 120.0
    wait: WaitConfig = WaitConfig()


@dataclass
class _Mailbox:
    segment: MailboxSegment
    pid: int
    gpu: object = None  # common.kernels.mailbox_gpu.GpuMailbox on a CUDA waiting side
    device_region: torch.Tensor | None = None  # uint8 [bytes]: a GPU worker's mailbox, in this device's memory
    layers: frozenset[int] = frozenset()  # the layers it computes (a GPU worker's graph waits for each)

    @property
    def on_device(self) -> bool:
        return self.device_region is not None


class MailboxPlane:
    def __init__(self, channel, config: MailboxConfig, *, hidden_size: int, top_k: int, dtype: torch.dtype,
                 device: torch.device, placement_invariant: bool, on_lost: Callable[[int, str], Exception],
                 channel_prefix: str = "attention") -> None:
        from moemesh.common.kernels.cpu_mailbox import load_mailbox

        self.channel = channel
        self.config = config
        self.device = torch.device(device)
        self.layout = MailboxLayout(config.max_tokens, hidden_size, top_k, hidden_bf16=dtype == torch.bfloat16,
                                    combine=CombineMode.SLOTS if placement_invariant else CombineMode.PARTIAL)
        self.on_lost = on_lost
        self.channel_prefix = channel_prefix
        self.library = load_mailbox()
        self._boxes: dict[int, _Mailbox] = {}
        self._refused: set[int] = set()
        self._table_token: object = None  # the routing table the attached mailboxes were offered under
        self.generation = 0  # grows whenever a mailbox is attached or dropped (captured graphs name segments)
        self.epoch = 0  # the step's epoch on a CPU waiting side
        if self.device.type == "cuda":  # on a CUDA waiting side both live on the device, in one tensor [1 + W]
            self._status = torch.zeros(1 + channel.num_workers, dtype=torch.int64, device=self.device)
            self.device_epoch = self._status[:1]  # [1]
            self.step_errors = self._status[1:]  # [W]
            self._status_host = torch.zeros(1 + channel.num_workers, dtype=torch.int64, pin_memory=True)
            self._status_copied = torch.cuda.Event()
        self._deferred = False  # confirm(defer=True) copied the status; confirm_deferred reads it
        self.num_layers_posted = 0
        self._step_rows: int | None = None  # rows of the step under way (doorbells rung), None between steps

    # ------------------------------------------------------------------ attach
    def ready(self, worker_index: int, table_token: object, owned: Callable[[int], list[tuple[int, int]]]) -> bool:
        """Whether worker `worker_index` takes this table's layers by mailbox, offering one when it has none.
        table_token: identifies the routing table (a new one re-offers every mailbox); owned(w): the pairs
        worker w computes under it."""
        if table_token != self._table_token:
            self.reset()
            self._table_token = table_token
        if worker_index in self._boxes:
            return True
        if worker_index in self._refused:
            return False
        return self._offer(worker_index, owned(worker_index))

    def _offer(self, worker_index: int, pairs: list[tuple[int, int]]) -> bool:
        from moemesh.common.kernels.mailbox_driver import wait_until_attached

        endpoint = self.channel.endpoints[worker_index]
        segment = MailboxSegment.create(self.layout, worker_index)
        region, shared = self._device_region(worker_index)
        message = AttachMailbox(channel_id=f"{self.channel_prefix}/{worker_index}", host_id=host_identity(),
                                segment_path=str(segment.path), owned_layers=tuple(p[0] for p in pairs),
                                owned_experts=tuple(p[1] for p in pairs), device_region=shared,
                                timeout_s=self.config.timeout_s)
        saved_timeout_s = self.channel.timeout_s
        self.channel.timeout_s = self.config.attach_timeout_s
        try:
            reply = self.channel.receive(worker_index, self.channel.send(worker_index, message))
            if isinstance(reply, MailboxAttached) and reply.accepted:
                wait_until_attached(segment, reply.pid, self.config.attach_timeout_s)
        except (ReplyTimeout, TimeoutError) as error:
            reply = f"{type(error).__name__}: {error}"
        finally:
            self.channel.timeout_s = saved_timeout_s
        gpu = None
        if isinstance(reply, MailboxAttached) and reply.accepted:
            region = region if reply.on_device else None
            try:
                gpu = self._gpu_side(segment, region)
            except RuntimeError as error:  # the pages could not be registered with CUDA
                self.library.store_release(segment.word_address(Word.STOP), 1)
                reply = f"{type(error).__name__}: {error}"
        if isinstance(reply, MailboxAttached) and reply.accepted:
            self._boxes[worker_index] = _Mailbox(segment, reply.pid, gpu, region, frozenset(p[0] for p in pairs))
            self.generation += 1
            log.info("attention.data_plane", endpoint=endpoint, data_plane="mailbox", worker_pid=reply.pid,
                     num_pairs=len(pairs), max_tokens=self.layout.t_max, timeout_s=self.config.timeout_s,
                     on_device=reply.on_device)
            if reply.on_device and self._step_rows is not None:  # offered mid-step: this step's doorbell
                gpu.ring_doorbell(self._step_rows)
            return True
        segment.close()
        self._refused.add(worker_index)
        reason = reply.reason if isinstance(reply, MailboxAttached) else str(reply)
        log.warning("attention.data_plane_fallback", endpoint=endpoint, data_plane="zmq", reason=reason[:300])
        return False

    def _device_region(self, worker_index: int):
        """On a CUDA waiting side: (uint8 [bytes] on this device with the header written, its CUDA IPC
        description) for a GPU worker to map; (None, None) elsewhere."""
        if self.device.type != "cuda":
            return None, None
        from moemesh.common.wire.cuda_ipc import export_buffer

        region = torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        header = torch.zeros(CONTROL_BYTES // 8, dtype=torch.int64)
        for word, value in self.layout.header_words(worker_index).items():
            header[word // 8] = value
        region[:CONTROL_BYTES].copy_(header.view(torch.uint8))
        return region, export_buffer(region)

    def _gpu_side(self, segment: MailboxSegment, device_region: torch.Tensor | None):
        if self.device.type != "cuda":
            return None
        from moemesh.common.kernels.mailbox_gpu import GpuMailbox, register_host_segment

        register_host_segment(segment)  # a CPU worker's mailbox, or a GPU worker's doorbell
        return GpuMailbox(segment, self.device_epoch, self.step_errors, timeout_ns=int(self.config.timeout_s * 1e9),
                          device_region=device_region)

    # ------------------------------------------------------------------ per step and layer
    def begin_step(self, num_rows: int) -> None:
        """A new epoch, before the step's first post (on CUDA a kernel, so a captured step advances it too);
        GPU workers' doorbells rung when the step's `num_rows` fit the mailboxes."""
        self.epoch += 1
        if self.device.type == "cuda":
            from moemesh.common.kernels.mailbox_gpu import advance_epoch

            advance_epoch(self.device_epoch)
        self._step_rows = num_rows if num_rows <= self.layout.t_max else None
        if self._step_rows is not None:
            for box in self._boxes.values():
                if box.on_device:
                    box.gpu.ring_doorbell(num_rows)

    def skip(self, layer: int, holders) -> None:
        """The layer goes another way in this step: an empty post to each GPU worker among `holders` whose
        graph waits for it (a doorbell was rung this step)."""
        if self._step_rows is None:
            return
        for worker_index in holders:
            box = self._boxes.get(worker_index)
            if box is not None and box.on_device and layer in box.layers:
                box.gpu.post_empty(layer)

    def post(self, worker_index: int, layer: int, hidden: torch.Tensor, ids: torch.Tensor,
             weights: torch.Tensor) -> int:
        """Write one layer's rows (hidden [T, D], ids / weights [T, K]) into the worker's mailbox and release
        its dispatch word -> the sequence number to collect (on CUDA: kernels, the number lives on the device)."""
        box = self._boxes[worker_index]
        self.num_layers_posted += 1
        if box.gpu is not None:
            box.gpu.post(layer, hidden, ids, weights)
            return -1
        segment, num_rows = box.segment, hidden.shape[0]
        if self.layout.hidden_bf16:
            segment.hidden[:num_rows] = hidden.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().view(
                segment.hidden.dtype)
        else:
            segment.hidden[:num_rows] = hidden.detach().to("cpu", torch.float32).numpy()
        segment.ids[:num_rows] = ids.detach().to("cpu", torch.int32).numpy()
        segment.weights[:num_rows] = weights.detach().to("cpu", torch.float32).numpy()
        seq = make_seq(self.epoch, layer)
        self.library.post(segment, seq, num_rows)
        return seq

    def collect(self, worker_index: int, layer: int, seq: int, num_rows: int) -> torch.Tensor:
        """Wait for the worker's answer to `seq` -> its fp32 output [T, D] (per slot: [T, K, D]); raises
        on_lost(worker) when it does not answer within timeout_s or reports an error."""
        box = self._boxes.get(worker_index)
        if box is None:
            raise self.on_lost(worker_index, f"layer {layer}: no mailbox")
        if box.gpu is not None:  # the stream waits (bounded); `confirm` reads the outcome after the step
            box.gpu.wait(layer)
            return box.gpu.combine_into(torch.empty((num_rows, *self.layout.combine_shape[1:]), dtype=torch.float32,
                                                    device=self.device), num_rows)
        segment = box.segment
        status, seen = self.library.wait(segment.word_address(Word.DONE_SEQ), seq, self.config.timeout_s,
                                         self.config.wait)
        cause = None
        if status != 0:
            code = MailboxError.TIMEOUT if status == 1 else MailboxError.PROTOCOL
            for word, value in ((Word.WAIT_ERROR_SEQ, seq), (Word.WAIT_ERROR_SEEN, seen),
                                (Word.WAIT_ERROR_WORKER, worker_index), (Word.WAIT_ERROR, int(code))):
                segment.set_word(word, value)
            cause = (f"layer {layer}: no answer within {self.config.timeout_s:.1f} s" if status == 1
                     else f"layer {layer}: done word {seen} past {seq}")
        elif segment.word(Word.WORKER_ERROR_SEQ) == seq:  # written before the done release: visible now
            cause = (f"layer {layer}: worker error {MailboxError(segment.word(Word.WORKER_ERROR)).name} "
                     f"(detail {segment.word(Word.WORKER_ERROR_DETAIL)})")
        if cause is not None:
            self.forget(worker_index)
            raise self.on_lost(worker_index, f"mailbox: {cause}")
        return torch.from_numpy(segment.combine[:num_rows]).clone()

    def confirm(self, defer: bool = False) -> None:
        """After a CUDA step (not while one is captured): raise on_lost for the first worker whose wait failed
        in this step's epoch, naming the layer from its segment's wait-error line (one read of the device).
        defer: only queue the read (into pinned memory, no host sync), so the host goes on with the step's
        sampling while the GPU runs; `confirm_deferred` checks it after the step's own sync."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._step_rows = None
        if self.device.type != "cuda" or not self._boxes or capturing:
            return
        if defer:
            self._status_host.copy_(self._status, non_blocking=True)
            self._status_copied.record()
            self._deferred = True
            return
        self._deferred = False
        self._raise_failed(self._status.tolist())  # one read: [epoch, step_errors...]

    def confirm_deferred(self) -> None:
        """The outcome `confirm(defer=True)` queued (already there once the step's tokens were read)."""
        if not self._deferred:
            return
        self._deferred = False
        self._status_copied.synchronize()
        self._raise_failed(self._status_host.tolist())

    def _raise_failed(self, values: list[int]) -> None:
        from moemesh.common.kernels.mailbox_driver import read_wait_error

        epoch = values[0]
        for worker_index in sorted(self._boxes):
            box = self._boxes[worker_index]
            segment = box.segment
            if values[1 + worker_index] == epoch:  # its wait timed out (or saw a later seq) in this step
                failure = read_wait_error(_DeviceWords(box.device_region) if box.on_device else segment)
                detail = (f"layer {failure.layer}: no answer within {self.config.timeout_s:.1f} s"
                          if failure is not None and failure.code is MailboxError.TIMEOUT
                          else failure.describe() if failure is not None else "wait failed")
            elif not box.on_device and segment.word(Word.WORKER_ERROR_SEQ) >> LAYER_BITS == epoch:  # it failed a layer
                detail = (f"layer {segment.word(Word.WORKER_ERROR_SEQ) & ((1 << LAYER_BITS) - 1)}: worker error "
                          f"{MailboxError(segment.word(Word.WORKER_ERROR)).name} (detail "
                          f"{segment.word(Word.WORKER_ERROR_DETAIL)})")
            else:
                continue
            self.forget(worker_index)
            raise self.on_lost(worker_index, f"mailbox: {detail}")

    # ------------------------------------------------------------------ lifecycle
    def forget(self, worker_index: int) -> None:
        """Drop a worker's mailbox (it failed, or may have restarted): offered again when used next."""
        box = self._boxes.pop(worker_index, None)
        self._refused.discard(worker_index)
        if box is not None:
            self.generation += 1
            self.library.store_release(box.segment.word_address(Word.STOP), 1)  # an attached loop ends between layers
            if box.gpu is not None:
                from moemesh.common.kernels.mailbox_gpu import unregister_host_segment

                torch.cuda.synchronize(self.device)  # no kernel may still address the pages
                unregister_host_segment(box.segment)
            box.segment.close()  # a GPU worker's mapping of the device region keeps it alive until it lets go

    def reset(self) -> None:
        """A new routing table: every mailbox is offered again (with its new pairs) when used next."""
        for worker_index in list(self._boxes):
            self.forget(worker_index)
        self._refused.clear()

    def close(self) -> None:
        self.reset()


class _DeviceWords:
    """A device mailbox's control words, read one at a time (a failure's wait-error line, after the step)."""

    def __init__(self, region: torch.Tensor) -> None:
        self.words = region[:CONTROL_BYTES].view(torch.int64)

    def word(self, which: Word) -> int:
        return int(self.words[which // 8].item())
