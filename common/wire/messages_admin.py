"""Admin channel messages: placement load / drop, inventory, memory and routing-statistics reports.

Part of the wire vocabulary registered in `common/wire/messages.py` (see its docstring for the
field types the codec understands); imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from moemesh.common.wire.messages_step import RoutingSummary


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
    # bytes the held experts take in the checkpoint (weights and scales as stored); num_weight_bytes is
    # what they occupy on the device (None: not reported)
    num_stored_weight_bytes: int | None = None


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
class EndWarmUp:
    """Router -> attention worker, after the start-time warm-up's last step (services/router/warm_up.py):
    drop the routing counts the synthetic steps added (placement is planned from real traffic only) and
    report what the warm-up captured. Answered by WarmUpEnded."""

    TYPE: ClassVar[str] = "end_warm_up"


@dataclass(frozen=True)
class WarmUpEnded:
    """num_graph_captures: decode graph sets (or whole-step graphs) the attention worker has captured;
    num_graph_steps / num_eager_steps: its steps replayed on graphs / run eagerly (all 0 without graphs)."""

    TYPE: ClassVar[str] = "warm_up_ended"
    num_graph_captures: int = 0
    num_graph_steps: int = 0
    num_eager_steps: int = 0


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
