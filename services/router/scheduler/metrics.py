"""A snapshot of the scheduler's gauges and cumulative counters, for the router's exporter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sized

    from moemesh.services.router.scheduler.kv_manager import KVBlockManager


@dataclass
class SchedulerCounters:
    """Cumulative counts since start (the exporter turns them into Prometheus counters)."""

    num_steps: int = 0
    num_computed_tokens: int = 0  # confirmed tokens computed (rejected drafts excluded)
    num_draft_tokens: int = 0  # drafts sent for verification
    num_accepted_drafts: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_finished_requests: int = 0
    num_aborted_requests: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting_requests: int
    num_waiting_prompt_tokens: int
    num_running_seqs: int
    num_swapped_seqs: int
    num_gpu_blocks_total: int
    num_gpu_blocks_used: int
    num_gpu_blocks_cached: int  # blocks carrying a prefix key, in use or reclaimable
    num_cpu_blocks_total: int
    num_cpu_blocks_used: int
    num_free_state_slots: int
    num_gpu_snapshots_total: int  # resume snapshots (resume_snapshots.py) per tier
    num_gpu_snapshots_used: int  # held by requests
    num_gpu_snapshots_cached: int  # kept for the prefix cache, held or reclaimable
    num_cpu_snapshots_total: int
    num_cpu_snapshots_used: int
    prefix_cache_queries: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    counters: SchedulerCounters


def collect_stats(
    kv: KVBlockManager,
    counters: SchedulerCounters,
    waiting: Sized,
    num_waiting_prompt_tokens: int,
    num_running_seqs: int,
    num_swapped_seqs: int,
) -> SchedulerStats:
    """Snapshot of a scheduler's state (kv is its KVBlockManager; counters are copied)."""
    return SchedulerStats(
        num_waiting_requests=len(waiting),
        num_waiting_prompt_tokens=num_waiting_prompt_tokens,
        num_running_seqs=num_running_seqs,
        num_swapped_seqs=num_swapped_seqs,
        num_gpu_blocks_total=kv.gpu.num_blocks,
        num_gpu_blocks_used=kv.gpu.num_used_blocks,
        num_gpu_blocks_cached=kv.gpu.num_cached_blocks,
        num_cpu_blocks_total=kv.cpu.num_blocks,
        num_cpu_blocks_used=kv.cpu.num_used_blocks,
        num_free_state_slots=kv.slots.num_free_slots,
        num_gpu_snapshots_total=kv.snapshots.gpu.num_blocks,
        num_gpu_snapshots_used=kv.snapshots.gpu.num_used_blocks,
        num_gpu_snapshots_cached=kv.snapshots.gpu.num_cached_blocks,
        num_cpu_snapshots_total=kv.snapshots.cpu.num_blocks,
        num_cpu_snapshots_used=kv.snapshots.cpu.num_used_blocks,
        prefix_cache_queries=kv.prefix_counters.num_queries,
        prefix_cache_queried_tokens=kv.prefix_counters.num_queried_tokens,
        prefix_cache_hit_tokens=kv.prefix_counters.num_hit_tokens,
        counters=SchedulerCounters(**vars(counters)),
    )
