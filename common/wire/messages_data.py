"""Data channel messages: attention <-> expert per MoE layer and micro-batch (ZeroMQ or CUDA IPC),
attention -> draft features.

Part of the wire vocabulary registered in `common/wire/messages.py` (see its docstring for the
field types the codec understands); imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # the annotation only; nothing here imports torch at run time
    from torch import Tensor


@dataclass(frozen=True)
class Dispatch:
    """Routed tokens of one MoE layer and micro-batch for one expert worker.

    `dispatch_id` is the sender's id for this round trip; the Combine echoes it together
    with step_id, layer and micro_batch so the receiver can check what it combines.
    Shapes: hidden [T, D] (bf16/f32), expert_ids [T, K] int32, weights [T, K] f32, where
    T tokens, K top-k, D hidden. Token t's slot k is for this worker iff slot_mask[t, k]
    (bool [T, K]); slot_mask None means every slot. The sender sends each worker only the
    tokens with at least one slot for it, and decides replicas by the mask, never the worker.
    """

    TYPE: ClassVar[str] = "dispatch"
    dispatch_id: int
    step_id: int
    layer: int
    micro_batch: int
    hidden: Tensor  # [T, D]
    expert_ids: Tensor  # [T, K] int32
    weights: Tensor  # [T, K] f32
    per_expert_outputs: bool = False
    slot_mask: Tensor | None = None  # [T, K] bool


@dataclass(frozen=True)
class Combine:
    """The expert worker's answer: output [T, D] (weighted partial sum over the slots it
    owns, added in slot order) or, with per_expert_outputs, [T, K, D] weighted per slot,
    zero where the slot is not its own (placement-invariant mode: the attention worker sums
    the K slots in slot order = expert-id order, so the result does not depend on placement)."""

    TYPE: ClassVar[str] = "combine"
    dispatch_id: int
    step_id: int
    layer: int
    micro_batch: int
    output: Tensor  # [T, D] or [T, K, D]
    per_expert_outputs: bool = False


@dataclass(frozen=True)
class SharedCudaBuffer:
    """A CUDA IPC description of one device buffer (torch's `_share_cuda_` fields, plain data):
    the peer maps it with `common.wire.cuda_ipc.import_buffer`. `num_bytes` uint8 elements from
    element `tensor_offset` of the shared storage."""

    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    num_bytes: int


@dataclass(frozen=True)
class AttachCudaIpc:
    """Attention -> expert, once per channel: use these shared device rings for this channel's
    Dispatches (common/wire/cuda_ipc.py explains the slots and the event protocol). The expert
    answers CudaIpcAttached; it refuses (accepted False, with the reason) when `host_id` is not its
    own host, it is not on CUDA, or mapping fails; the sender then stays on ZeroMQ.
    dispatch_event_handles [S]: the attention side's events, recorded after a slot is written."""

    TYPE: ClassVar[str] = "attach_cuda_ipc"
    channel_id: str
    host_id: str
    num_slots: int
    max_tokens: int
    hidden_size: int
    top_k: int
    hidden_dtype: str
    per_expert_outputs: bool
    dispatch_region: SharedCudaBuffer
    combine_region: SharedCudaBuffer
    dispatch_event_handles: tuple[bytes, ...]
    sync: str = "events"  # "flags" (stream memory operations) or "events"; the expert may answer "events"


@dataclass(frozen=True)
class CudaIpcAttached:
    """Expert -> attention: whether the rings of `channel_id` are mapped; combine_event_handles [S]
    are the expert's events, recorded after it wrote a slot's output."""

    TYPE: ClassVar[str] = "cuda_ipc_attached"
    channel_id: str
    accepted: bool
    reason: str = ""
    combine_event_handles: tuple[bytes, ...] = ()
    sync: str = "events"  # the ordering both sides use from now on


@dataclass(frozen=True)
class AttachMailbox:
    """Attention -> expert, once per channel and routing table: serve this attention worker's MoE layers
    through the host-memory mailbox at `segment_path` (docs/device-step.md: layout, sequence numbers,
    errors) with the native worker loop, no message per layer. A GPU worker on the attention worker's
    device takes `device_region` instead (the mailbox in device memory, CUDA IPC) and replays a CUDA
    graph per step, the host segment's dispatch word its doorbell. The worker computes the pairs
    (owned_layers[i], owned_experts[i]) for this channel: its share of the attention worker's owner
    table. Answered by MailboxAttached; refused (accepted False, with the reason) when `host_id` is not
    its host, it runs neither FP4 experts on the CPU nor quantized experts on the offered GPU, it does not
    hold a pair, or the segment does not check. A new AttachMailbox on the same channel replaces the previous one."""

    TYPE: ClassVar[str] = "attach_mailbox"
    channel_id: str
    host_id: str
    segment_path: str
    owned_layers: tuple[int, ...]
    owned_experts: tuple[int, ...]
    device_region: SharedCudaBuffer | None = None  # a CUDA attention worker: the same layout in its device memory
    timeout_s: float = 2.0  # a GPU worker's graph gives up a step after waiting this long for a layer


@dataclass(frozen=True)
class MailboxAttached:
    """Expert -> attention: whether the worker loop of `channel_id` runs; pid: the process serving it;
    on_device: it serves the device region (a GPU worker), not the host segment."""

    TYPE: ClassVar[str] = "mailbox_attached"
    channel_id: str
    accepted: bool
    reason: str = ""
    pid: int = 0
    on_device: bool = False


@dataclass(frozen=True)
class DispatchSlot:
    """A Dispatch whose tensors are in slot `slot` of the attached rings of `channel_id` (the
    first num_tokens rows; slot_mask valid iff has_slot_mask). Answered by CombineSlot."""

    TYPE: ClassVar[str] = "dispatch_slot"
    dispatch_id: int
    step_id: int
    layer: int
    micro_batch: int
    channel_id: str
    slot: int
    num_tokens: int
    per_expert_outputs: bool = False
    has_slot_mask: bool = False
    sequence: int = 0  # this use of the slot (flags: the dispatch flag value to wait for)


@dataclass(frozen=True)
class CombineSlot:
    """The output of DispatchSlot `dispatch_id` is in combine slot `slot` (valid once the slot's
    combine event, recorded before this was sent, has completed)."""

    TYPE: ClassVar[str] = "combine_slot"
    dispatch_id: int
    step_id: int
    layer: int
    micro_batch: int
    slot: int
    num_tokens: int
    per_expert_outputs: bool = False
    sequence: int = 0


@dataclass(frozen=True)
class FeatureSegment:
    """Rows `row_start ..< row_start + num_rows` of TargetFeatures.features belong to
    `request_id` at positions `start_position ...`, with the target tokens `token_ids`."""

    request_id: str
    row_start: int
    num_rows: int
    start_position: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TargetFeatures:
    """Attention -> draft worker: the target hidden features DSpark conditions on.
    features [N, F]: N rows over all segments, F feature width."""

    TYPE: ClassVar[str] = "target_features"
    step_id: int
    segments: tuple[FeatureSegment, ...]
    features: Tensor  # [N, F]
