"""Single-launch split-K: the last program of each output tile sums the partials ("fix-up").

Legend: S split-K parts, T rows of the output tile (tokens or routed rows), N output features.

Split-K cuts the K loop of one output tile over S programs so that a decode-size matmul (few
output tiles, long K) fills the SMs. Each program writes its fp32 partial [T, N] into a workspace
[S, rows, cols], then takes a ticket from the tile's counter (an atomic add, acq_rel at GPU scope);
the program that draws ticket S - 1 is the last one: it reads the S partials in order s = 0..S-1
(so the sum is deterministic, whatever the arrival order), applies the epilogue, stores the output
and puts the counter back to 0. One launch, no memset, no second kernel, no atomics on data.

The counters live in one int32 buffer per device that stays all-zero between launches; it is
created on the first split-K launch (outside or inside a CUDA-graph capture: under capture the
zeroing becomes a graph node, harmless since the counters are zero whenever no kernel runs).
Invariant: split-K launches on one device do not run concurrently on two streams (they would
share counters); moemesh runs one compute stream per process.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COUNTERS = 1 << 20  # 4 MiB of int32; one counter per output tile of a launch

_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The device's zeroed counter buffer (at least `num_tiles` entries)."""
    if num_tiles > MAX_COUNTERS:
        raise ValueError(f"{num_tiles} split-K tiles exceed the {MAX_COUNTERS} counters")
    buffer = _counters.get(device)
    if buffer is None:
        buffer = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
        _counters[device] = buffer
    return buffer


@triton.jit
def take_ticket(counter_ptr, NUM_SPLITS):
    """Called after this program stored its partial: True in the program that arrives last (NUM_SPLITS
    programs share the counter; a constexpr or a runtime value).

    The barrier puts every thread's partial stores before the one thread's release (the atomic);
    the last program's acquire then sees all S partials. The last program resets the counter.
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == NUM_SPLITS - 1
    tl.store(counter_ptr, 0, mask=is_last)
    return is_last
