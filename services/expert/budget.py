"""What an expert worker holds against what it may hold: the `ExpertInventory` it reports, and the
refusal of a `LoadExperts` that would take more than its expert budget (the bytes the startup
budget leaves it, common/placement/worker_budget.py). `holdings` is the worker's `ExpertHoldings`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import structlog
import torch

from moemesh.common.wire.messages import ErrorCode, ErrorReply, ExpertInventory, ExpertKey

if TYPE_CHECKING:
    from moemesh.services.expert.worker import ExpertWorkerConfig

log = structlog.get_logger("expert")


def device_memory(device: torch.device) -> tuple[int, int | None]:
    """(bytes used, bytes total or None): allocator bytes on CUDA, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), None
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None


def expert_inventory(config: ExpertWorkerConfig, device: torch.device, placement_version: int,
                     holdings) -> ExpertInventory:
    used, total = device_memory(device)
    budget = config.expert_budget_bytes
    resident = holdings.resident_bytes()
    return ExpertInventory(
        name=config.name, device=str(device), placement_version=placement_version,
        experts=tuple(ExpertKey(layer=l, expert=e) for l, e in holdings.pairs),
        num_weight_bytes=resident, memory_used_bytes=used, memory_total_bytes=total,
        free_budget_bytes=None if budget is None else budget - resident,
        num_stored_weight_bytes=holdings.stored_bytes())


def load_refusal(config: ExpertWorkerConfig, device: torch.device, holdings, model_config, pairs) -> ErrorReply | None:
    """ErrorReply naming the device and the shortfall when `pairs` do not fit the budget left."""
    budget = config.expert_budget_bytes
    new = {(int(l), int(e)) for l, e in pairs} - set(holdings.pairs)
    if budget is None or not new or model_config is None:
        return None
    from moemesh.common.placement.worker_budget import resident_bytes_per_expert

    if len(holdings):  # what the held experts really take
        per_expert = -(-holdings.resident_bytes() // len(holdings))
    else:
        per_expert = resident_bytes_per_expert(model_config, config.expert_dtype)
    needed = holdings.resident_bytes() + len(new) * per_expert
    if needed <= budget:
        return None
    from moemesh.common.placement.devices import format_bytes

    log.error("expert.load_refused", name=config.name, device=str(device), num_new=len(new),
              needed_bytes=needed, budget_bytes=budget)
    return ErrorReply(code=ErrorCode.OVERLOADED, message=(
        f"{config.name} on {device}: {len(new)} more experts need {format_bytes(needed)} in all, the "
        f"budget for experts is {format_bytes(budget)}; short by {format_bytes(needed - budget)}"))
