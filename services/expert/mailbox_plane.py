"""The expert side of the mailbox: a worker loop per attention worker, no message per layer.

`attach(AttachMailbox, holdings, ...) -> MailboxAttached`, when the attention worker is on this host:
- this worker keeps FP4 experts on the CPU: map its host segment and start a `MailboxWorker` (common/
  kernels/cpu_mailbox.py: a C thread that waits on the segment's dispatch word, runs the FP4 kernel over
  the slots of the pairs it owns and releases the done word; docs/device-step.md has the protocol);
- this worker is on the attention worker's GPU with quantized experts on the grouped kernels, and the offer
  carries a device region: map it through CUDA IPC and start a `GpuMailboxWorker` (gpu_mailbox.py: one
  CUDA graph replay per step, the host segment as the step's doorbell); the answer says `on_device`.
Otherwise refuse with the reason; the attention worker then stays on ZeroMQ for this worker.
The thread keeps the stacks it was started with referenced, so a later LoadExperts / DropExperts that
rebuilds the holder never frees memory the thread reads; the attention worker attaches again (a new
segment and table) when its routing table changes, which replaces the channel's thread.
"""

from __future__ import annotations

import os

import structlog
import torch

from moemesh.common.checkpoint.expert_holdings import ExpertHoldings
from moemesh.common.checkpoint.expert_stacks import ResidentFormat
from moemesh.common.wire.cuda_ipc import host_identity
from moemesh.common.wire.messages import AttachMailbox, MailboxAttached

log = structlog.get_logger("expert")


class ExpertMailboxes:
    def __init__(self, device: torch.device, name: str = "expert") -> None:
        self.device = torch.device(device)
        self.name = name
        self._workers: dict[str, object] = {}  # channel id -> running MailboxWorker or GpuMailboxWorker

    def attach(self, message: AttachMailbox, holdings: ExpertHoldings, num_layers: int, num_experts: int,
               swiglu_limit: float | None, route_before_w2: bool, num_threads: int) -> MailboxAttached:
        self._stop(message.channel_id)  # a new table for this channel replaces the old thread
        try:
            worker = self._start(message, holdings, num_layers, num_experts, swiglu_limit, route_before_w2,
                                 num_threads)
        except (ValueError, OSError, RuntimeError) as error:
            reason = f"{type(error).__name__}: {error}"[:300]
            log.warning("expert.mailbox_refused", name=self.name, channel_id=message.channel_id, reason=reason)
            return MailboxAttached(channel_id=message.channel_id, accepted=False, reason=reason)
        self._workers[message.channel_id] = worker
        on_device = self.device.type == "cuda"
        log.info("expert.mailbox_attached", name=self.name, channel_id=message.channel_id,
                 segment=message.segment_path, num_pairs=len(message.owned_layers),
                 num_threads=None if on_device else num_threads, on_device=on_device)
        return MailboxAttached(channel_id=message.channel_id, accepted=True, pid=os.getpid(), on_device=on_device)

    def _start(self, message: AttachMailbox, holdings: ExpertHoldings, num_layers: int, num_experts: int,
               swiglu_limit: float | None, route_before_w2: bool, num_threads: int):
        if message.host_id != host_identity():
            raise ValueError(f"peer host {message.host_id!r} is not this host {host_identity()!r}")
        if len(message.owned_layers) != len(message.owned_experts):
            raise ValueError("owned_layers and owned_experts differ in length")
        if self.device.type == "cuda":
            return self._start_on_device(message, holdings, num_layers, num_experts)
        if self.device.type != "cpu":
            raise ValueError(f"expert worker {self.name} is on {self.device}, neither the CPU nor CUDA")
        from moemesh.common.kernels.cpu_mailbox import ExpertMath, MailboxWorker, load_mailbox
        from moemesh.common.kernels.mailbox_layout import MailboxSegment
        from moemesh.common.model.cpu_experts import layer_stacks

        if holdings.format is not ResidentFormat.FP4 or holdings.experts is None:
            raise ValueError(f"experts kept as {holdings.format}, not FP4")
        layers = holdings.experts._layers
        local = torch.full((num_layers, num_experts), -1, dtype=torch.int64)  # [L, E] stack index or -1
        for layer, expert in zip(message.owned_layers, message.owned_experts):
            held = layers.get(layer)
            if held is None or not 0 <= expert < num_experts or not bool(held.held[expert]):
                raise ValueError(f"pair ({layer}, {expert}) is not held here")
            local[layer, expert] = held.local[expert]
        owned_layers = set(message.owned_layers)
        stacks = [layer_stacks(layers[layer]) if layer in owned_layers else None for layer in range(num_layers)]
        segment = MailboxSegment.attach(message.segment_path)
        return MailboxWorker(load_mailbox(), segment, stacks, local, ExpertMath(swiglu_limit, route_before_w2),
                             num_threads=num_threads)

    def _start_on_device(self, message: AttachMailbox, holdings: ExpertHoldings, num_layers: int, num_experts: int):
        from moemesh.common.kernels.cpu_mailbox import load_mailbox
        from moemesh.common.kernels.mailbox_layout import MailboxSegment
        from moemesh.common.model.quantized import KernelBackend
        from moemesh.common.wire.cuda_ipc import cuda_device, import_buffer
        from moemesh.services.expert.gpu_mailbox import GpuMailboxWorker, doorbell_wait

        if message.device_region is None:
            raise ValueError("the offer has no device region (the attention worker is not on CUDA)")
        device = cuda_device(self.device)
        if message.device_region.device_index != device.index:
            raise ValueError(f"the mailbox is on cuda:{message.device_region.device_index}, this worker on {device}: "
                             "a device mailbox serves one GPU")
        experts = holdings.experts
        if experts is None or experts.backend is KernelBackend.TORCH:
            raise ValueError(f"experts kept as {holdings.format} without the grouped kernels")
        owned = torch.zeros(num_layers, num_experts, dtype=torch.bool)  # [L, E]
        for layer, expert in zip(message.owned_layers, message.owned_experts):
            held = experts._layers.get(layer)
            if held is None or not 0 <= expert < num_experts or not bool(held.held[expert]):
                raise ValueError(f"pair ({layer}, {expert}) is not held here")
            owned[layer, expert] = True
        segment = MailboxSegment.attach(message.segment_path)
        try:
            region = import_buffer(message.device_region)
            return GpuMailboxWorker(load_mailbox(), segment, region, experts, owned.to(device),
                                    tuple(sorted(set(message.owned_layers))), message.timeout_s,
                                    doorbell_wait(), name=self.name)
        except Exception:
            segment.close(unlink=False)
            raise

    def _stop(self, channel_id: str) -> None:
        worker = self._workers.pop(channel_id, None)
        if worker is not None:
            worker.stop()

    def close(self) -> None:
        for channel_id in list(self._workers):
            self._stop(channel_id)
