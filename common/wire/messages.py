"""Every message moemesh sends between processes, registered here, grouped by channel.

Each message is a frozen dataclass with a `TYPE` tag (the string on the wire) and typed
fields drawn from a small vocabulary the codec understands (`common.wire.schema`): int,
float, bool, str, bytes, `X | None`, `tuple[X, ...]`, fixed tuples, `dict[str, Any]`
(plain msgpack data), `StrEnum`s, nested frozen dataclasses, and `Tensor` (a raw frame).
Receivers dispatch with `match message: case Dispatch(): ...`.

Channels (docs/design.md §3):
- control: router <-> attention / draft, registration, readiness, heartbeats, drain;
- data:    attention <-> expert per MoE layer and micro-batch, attention -> draft features;
- admin:   placement load / drop, inventory and memory reports, the end of the start-time warm-up.

The classes live in one module per channel (`messages_lifecycle`, `messages_step`,
`messages_draft`, `messages_data`, `messages_admin`; enums in `message_enums`); this module is the
one place that lists them all, and every sender and receiver imports them from here.

Sequences are tuples so messages stay immutable; senders may pass lists (the encoder accepts
both), decoders always return tuples. This module imports no torch: `Tensor` fields are
annotated with the string "Tensor" and only the tensor-frame path imports torch.
"""

from __future__ import annotations

from moemesh.common.wire.message_enums import ServiceRole, ServiceState, RoutingPhase, ErrorCode  # noqa: F401
from moemesh.common.wire.messages_lifecycle import (  # noqa: F401
    Register,
    Ready,
    Heartbeat,
    Drain,
    Shutdown,
    Ping,
    Pong,
    Ack,
    ErrorReply,
)
from moemesh.common.wire.messages_step import (  # noqa: F401
    ScheduledSequence,
    PrefixRestore,
    StepPlan,
    TokenLogprobs,
    SequenceResult,
    LayerRoutingSkew,
    RoutingSummary,
    StepCounters,
    StepResult,
)
from moemesh.common.wire.messages_draft import (  # noqa: F401
    DraftSlot,
    DraftRequest,
    DraftProposal,
    DraftTokens,
)
from moemesh.common.wire.messages_data import (  # noqa: F401
    Dispatch,
    Combine,
    SharedCudaBuffer,
    AttachCudaIpc,
    CudaIpcAttached,
    AttachMailbox,
    MailboxAttached,
    DispatchSlot,
    CombineSlot,
    FeatureSegment,
    TargetFeatures,
)
from moemesh.common.wire.messages_admin import (  # noqa: F401
    ExpertKey,
    LoadExperts,
    DropExperts,
    QueryInventory,
    ExpertInventory,
    MemoryReport,
    WriteRoutingStats,
    RoutingStatsWritten,
    EndWarmUp,
    WarmUpEnded,
    PlacementWorker,
    SwitchPlacement,
)

# Bumped on any incompatible change of a field, a tag or the framing. Peers with another
# version are refused at decode time (WireError), never half-understood.
PROTOCOL_VERSION = 1

CONTROL_MESSAGES: tuple[type, ...] = (
    Register, Ready, Heartbeat, Drain, Shutdown, Ping, Pong, Ack, ErrorReply,
    StepPlan, StepResult, DraftRequest, DraftTokens,
)
DATA_MESSAGES: tuple[type, ...] = (Dispatch, Combine, TargetFeatures, AttachCudaIpc, CudaIpcAttached, DispatchSlot,
                                   CombineSlot, AttachMailbox, MailboxAttached)
ADMIN_MESSAGES: tuple[type, ...] = (
    LoadExperts, DropExperts, QueryInventory, ExpertInventory, MemoryReport, WriteRoutingStats, RoutingStatsWritten,
    SwitchPlacement, EndWarmUp, WarmUpEnded,
)
ALL_MESSAGES: tuple[type, ...] = CONTROL_MESSAGES + DATA_MESSAGES + ADMIN_MESSAGES

# TYPE tag -> class, for the decoder. Tags are unique (checked by the tests).
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in ALL_MESSAGES}
