"""The attention worker's step counters added up over decode steps, for `/status.json` and benchmarks.

Each StepResult carries `StepCounters` (services/attention/step_counters.py): ZeroMQ messages for layers
and, when counted, synchronising CUDA calls. `DecodeStepTotals` keeps their sums over decode steps only
(prefill steps send more by design), with the router's wall time of those steps; `moemesh bench serve`
reads them before and after its run and reports the mean decode step time and the counts per step and
per layer. Plain Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moemesh.common.wire.messages import StepCounters


@dataclass
class DecodeStepTotals:
    num_steps: int = 0
    num_layers: int = 0  # of the last counted step's model
    data_messages: int = 0
    host_sync_steps: int = 0  # decode steps whose host syncs were counted
    host_syncs: int = 0
    seconds: float = 0.0  # the router's wall time of those steps (plan sent .. result received)

    def add(self, counters: StepCounters | None, step_s: float) -> None:
        if counters is None or not counters.decode:
            return
        self.num_steps += 1
        self.seconds += step_s
        self.num_layers = counters.num_layers
        self.data_messages += counters.data_messages
        if counters.host_syncs >= 0:
            self.host_sync_steps += 1
            self.host_syncs += counters.host_syncs

    def to_json(self) -> dict:
        return asdict(self)
