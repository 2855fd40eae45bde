"""Every message moemesh sends between processes, in one file, grouped by channel.

Each message is a frozen dataclass with a `TYPE` tag (the string on the wire) and typed
fields drawn from a small vocabulary the codec understands (`common.wire.schema`): int,
float, bool, str, bytes, `X | None`, `tuple[X, ...]`, fixed tuples, `dict[str, Any]`
(plain msgpack data), `StrEnum`s, nested frozen dataclasses, and `Tensor` (a raw frame).
Receivers dispatch with `match message: case Dispatch(): ...`.

Channels (architecture.md §3):
- control: router <-> attention / draft, registration, readiness, heartbeats, drain;
- data:    attention <-> expert per MoE layer and micro-batch, attention -> draft features;
- admin:   placement load / drop, inventory and memory reports.

Sequences are tuples so messages stay immutable; senders may pass lists (the encoder accepts
both), decoders always return tuples. This module imports no torch: `Tensor` fields are
annotated with the string "Tensor" and only the tensor-frame path imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # the annotation only; nothing here imports torch at run time
    from torch import Tensor

# Bumped on any incompatible change of a field, a tag or the framing. Peers with another
# version are refused at decode time (WireError), never half-understood.
PROTOCOL_VERSION = 1


class ServiceRole(StrEnum):
    ROUTER = "router"
    ATTENTION = "attention"
    EXPERT = "expert"
    DRAFT = "draft"
    SUPERVISOR = "supervisor"


class ServiceState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


class RoutingPhase(StrEnum):
    """Which tokens a routing count covers: prompt tokens, generated tokens, or both."""

    PREFILL = "prefill"
    DECODE = "decode"
    ALL = "all"


class ErrorCode(StrEnum):
    MALFORMED = "malformed"  # the request could not be decoded
    UNEXPECTED = "unexpected"  # decoded, but this receiver does not handle that type
    DRAINING = "draining"  # the receiver is shutting down and accepts nothing new
    OVERLOADED = "overloaded"
    NOT_FOUND = "not_found"  # e.g. an expert that this worker does not hold
    INTERNAL = "internal"


# --------------------------------------------------------------------------------------
# control channel: registration, readiness, liveness, shutdown
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Register:
    """A worker announces itself to the router: who it is and where it listens."""

    TYPE: ClassVar[str] = "register"
    name: str
    role: ServiceRole
    pid: int
    host: str
    device: str
    endpoint: str


@dataclass(frozen=True)
class Ready:
    """Sent once by a service when it has loaded everything and accepts work."""

    TYPE: ClassVar[str] = "ready"
    name: str
    role: ServiceRole
    pid: int
    endpoint: str
    device: str = "cpu"


@dataclass(frozen=True)
class Heartbeat:
    """Periodic liveness report; `sequence` increases by one per beat from each sender."""

    TYPE: ClassVar[str] = "heartbeat"
    name: str
    role: ServiceRole
    state: ServiceState
    sequence: int
    num_inflight: int = 0


@dataclass(frozen=True)
class Drain:
    """Ask a service to stop accepting work, finish what is in flight, then exit 0."""

    TYPE: ClassVar[str] = "drain"
    reason: str = ""


@dataclass(frozen=True)
class Shutdown:
    """Ask a service to exit now; in-flight work is answered with ErrorReply(DRAINING)."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""


@dataclass(frozen=True)
class Ping:
    """Liveness probe answered by `Pong` with the same nonce."""

    TYPE: ClassVar[str] = "ping"
    nonce: int


@dataclass(frozen=True)
class Pong:
    TYPE: ClassVar[str] = "pong"
    nonce: int
    name: str = ""


@dataclass(frozen=True)
class Ack:
    """Generic positive reply to a request that has no richer answer (Register, Drain, ...)."""

    TYPE: ClassVar[str] = "ack"
    detail: str = ""


@dataclass(frozen=True)
class ErrorReply:
    """The reply to a request that failed; `request_id` names the client request if any."""

    TYPE: ClassVar[str] = "error"
    code: ErrorCode
    message: str
    request_id: str | None = None


# --------------------------------------------------------------------------------------
# control channel: router <-> attention worker, one step
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step.

    Invariants: `token_ids` are the tokens to compute this step, at positions
    `start_position ..< start_position + len(token_ids)`; the last `len(draft_token_ids)`
    of them are drafts to verify. `block_ids` holds the full block table per tier
    (index 0 = GPU pool). `sampling` is `SamplingParams.to_wire()`, sent at least the
    first time a sequence is scheduled (None afterwards: the worker keeps it per slot).

    Speculation (services/router/engine_drafts.py): a sampled request's drafts come with the
    sparse distribution each was drawn from (`draft_support_*[i]` for draft i, as in
    DraftProposal; empty for greedy requests). `send_features`: send this sequence's
    committed target features to the draft worker after the step.
    """

    request_id: str
    seq_slot: int
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[tuple[int, ...], ...]
    do_sample: bool
    sampling: dict[str, Any] | None = None
    draft_token_ids: tuple[int, ...] = ()
    draft_support_token_ids: tuple[tuple[int, ...], ...] = ()
    draft_support_probs: tuple[tuple[float, ...], ...] = ()
    send_features: bool = False
    # With `sampling` (a sequence starting in its slot): its tokens before start_position and its
    # prompt length, so penalties and seeded random streams survive preemption and prefix hits.
    prior_token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int | None = None


@dataclass(frozen=True)
class PrefixRestore:
    """Resume `seq_slot` from cached prefix blocks holding its first `num_tokens` tokens."""

    request_id: str
    seq_slot: int
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class StepPlan:
    """Router -> attention worker: everything one step computes and every block move it needs.

    Block moves run before the step's compute: swap_out pairs are (gpu_block, cpu_block),
    swap_in pairs are (cpu_block, gpu_block). `free_seq_slots` are released after the step.
    Plain integers only, so the router's scheduler output maps onto it without torch.
    """

    TYPE: ClassVar[str] = "step_plan"
    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    free_seq_slots: tuple[int, ...] = ()
    prefix_restores: tuple[PrefixRestore, ...] = ()


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of each emitted token and, if asked, its top alternatives (same length lists)."""

    logprobs: tuple[float, ...]
    top_token_ids: tuple[tuple[int, ...], ...] = ()
    top_logprobs: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True)
class SequenceResult:
    """One sequence's outcome of a step: the tokens it gained (accepted drafts + sampled)."""

    request_id: str
    token_ids: tuple[int, ...]
    num_draft_accepted: int = 0
    logprobs: TokenLogprobs | None = None
    error: str | None = None


@dataclass(frozen=True)
class LayerRoutingSkew:
    """How unevenly one MoE layer's routed activations spread over its experts in one phase
    (see `common.placement.stats.LayerSkew`: max_over_mean 1.0 = uniform, top8_share of the
    8 hottest experts, effective_experts = exp(entropy), num_unused never selected)."""

    layer: int
    phase: RoutingPhase
    num_activations: int
    max_over_mean: float
    top8_share: float
    effective_experts: float
    num_unused: int


@dataclass(frozen=True)
class RoutingSummary:
    """The attention worker's routing statistics since it started, reduced to per-layer skew:
    one entry per (measured phase, layer) plus the ALL phase for every layer. `layer_counts`
    carries the raw activations per (layer, expert), all phases together, [L][E] (the status
    page's heat map; L x E ints every few steps is small next to a step's tensors); empty when
    the sender does not send them."""

    num_steps: int
    layers: tuple[LayerRoutingSkew, ...]
    layer_counts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """Attention worker -> router, the answer to one StepPlan (same step_id). `routing` is
    attached every few steps (the worker's `summary_every_steps`), None otherwise."""

    TYPE: ClassVar[str] = "step_result"
    step_id: int
    sequences: tuple[SequenceResult, ...]
    routing: RoutingSummary | None = None


# --------------------------------------------------------------------------------------
# control channel: router <-> draft worker
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftSlot:
    """What the drafter should propose for one request after `step_id`.

    `last_token_ids` are the request's newest tokens at positions `start_position ...`; the
    last of them is the seed (anchor), so the seed position is
    `start_position + len(last_token_ids) - 1` and draft slot k predicts the token at the seed
    position + 1 + k. `num_draft_tokens` caps the drafts wanted (the drafter's width policy may
    return fewer). Sampled requests (temperature > 0) need `seed` and
    `first_output_position`, the output position (tokens generated so far) of draft slot 0:
    the drafter's random streams are keyed by it, like the verifier's.
    """

    request_id: str
    num_draft_tokens: int
    last_token_ids: tuple[int, ...]
    start_position: int
    temperature: float = 0.0
    seed: int | None = None
    first_output_position: int | None = None


@dataclass(frozen=True)
class DraftRequest:
    TYPE: ClassVar[str] = "draft_request"
    step_id: int
    slots: tuple[DraftSlot, ...]
    finished_request_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class DraftProposal:
    """Drafts for one request: `draft_probs[i]` is q(token_ids[i]) under the drafter,
    `confidences[i]` the drafter's own acceptance estimate; all three have one length.

    Sampled requests also carry the exact distribution each draft was drawn from, sparse:
    slot i's q is `support_probs[i][j]` at token `support_token_ids[i][j]` and exactly 0
    elsewhere (the drafter samples from that sparse distribution itself, so rejection
    sampling against it is lossless). Empty for greedy requests.
    """

    request_id: str
    token_ids: tuple[int, ...]
    draft_probs: tuple[float, ...]
    confidences: tuple[float, ...]
    support_token_ids: tuple[tuple[int, ...], ...] = ()
    support_probs: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True)
class DraftTokens:
    """Draft worker -> router / attention worker."""

    TYPE: ClassVar[str] = "draft_tokens"
    step_id: int
    proposals: tuple[DraftProposal, ...]


# --------------------------------------------------------------------------------------
# data channel: attention <-> expert, attention -> draft
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# admin channel: placement and inventory
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertKey:
    layer: int
    expert: int


@dataclass(frozen=True)
class LoadExperts:
    """Load these (layer, expert) shards from the checkpoint; answered by ExpertInventory.
    Loading never changes what serves traffic until the router switches `placement_version`."""

    TYPE: ClassVar[str] = "load_experts"
    placement_version: int
    experts: tuple[ExpertKey, ...]
    checkpoint_path: str = ""
    dtype: str = ""


@dataclass(frozen=True)
class DropExperts:
    TYPE: ClassVar[str] = "drop_experts"
    placement_version: int
    experts: tuple[ExpertKey, ...]


@dataclass(frozen=True)
class QueryInventory:
    TYPE: ClassVar[str] = "query_inventory"


@dataclass(frozen=True)
class ExpertInventory:
    """What an expert worker holds and what memory it uses (bytes). The router queries it when
    a worker announces itself (Ready) to record the worker and what it holds."""

    TYPE: ClassVar[str] = "expert_inventory"
    name: str
    device: str
    placement_version: int
    experts: tuple[ExpertKey, ...]
    num_weight_bytes: int
    memory_used_bytes: int
    memory_total_bytes: int | None = None
    # routed-expert bytes this worker may still load under its startup budget (None: not measured)
    free_budget_bytes: int | None = None


@dataclass(frozen=True)
class MemoryReport:
    """Any worker's memory use; KV block counts are for attention workers (None elsewhere)."""

    TYPE: ClassVar[str] = "memory_report"
    name: str
    device: str
    memory_used_bytes: int
    memory_total_bytes: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None


@dataclass(frozen=True)
class WriteRoutingStats:
    """Ask an attention worker to write its routing statistics now (Lucebox hotness tables:
    `path`, `path.prefill.csv`, `path.decode.csv`); an empty path means its
    `--routing-stats-out` file. Answered by RoutingStatsWritten, or ErrorReply when neither
    names a file."""

    TYPE: ClassVar[str] = "write_routing_stats"
    path: str = ""


@dataclass(frozen=True)
class RoutingStatsWritten:
    TYPE: ClassVar[str] = "routing_stats_written"
    paths: tuple[str, ...]
    summary: RoutingSummary


@dataclass(frozen=True)
class PlacementWorker:
    """One expert worker of a placement: where it listens and which pairs it serves."""

    name: str
    endpoint: str
    experts: tuple[ExpertKey, ...]
    replicas: tuple[ExpertKey, ...] = ()


@dataclass(frozen=True)
class SwitchPlacement:
    """Router -> attention worker: dispatch by this placement from the next step on (live
    placement changes). Sent only after every worker holds its pairs; the attention worker
    applies it between two steps (its loop handles one message at a time) and answers Ack, or
    ErrorReply when a pair has no owner (the old placement then stays)."""

    TYPE: ClassVar[str] = "switch_placement"
    placement_version: int
    workers: tuple[PlacementWorker, ...]


CONTROL_MESSAGES: tuple[type, ...] = (
    Register, Ready, Heartbeat, Drain, Shutdown, Ping, Pong, Ack, ErrorReply,
    StepPlan, StepResult, DraftRequest, DraftTokens,
)
DATA_MESSAGES: tuple[type, ...] = (Dispatch, Combine, TargetFeatures, AttachCudaIpc, CudaIpcAttached, DispatchSlot,
                                   CombineSlot)
ADMIN_MESSAGES: tuple[type, ...] = (
    LoadExperts, DropExperts, QueryInventory, ExpertInventory, MemoryReport, WriteRoutingStats, RoutingStatsWritten,
    SwitchPlacement,
)
ALL_MESSAGES: tuple[type, ...] = CONTROL_MESSAGES + DATA_MESSAGES + ADMIN_MESSAGES

# TYPE tag -> class, for the decoder. Tags are unique (checked by the tests).
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in ALL_MESSAGES}
