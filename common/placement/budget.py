"""The startup memory budget every worker reports before it allocates anything big.

A worker adds up what it plans to put on its device (weights, KV pools, activations, CUDA graphs,
the routed experts its placement gives it, a safety reserve), compares that with the device's free
memory, logs one structured `<service>.memory_budget` event, and refuses to start when the sum
does not fit, with a message naming the device and the shortfall. Failing here, in a second, beats
an out-of-memory error minutes into loading weights. Pure arithmetic: the caller measures free
memory (torch.cuda.mem_get_info, /proc/meminfo) and passes it in.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.common.placement.devices import format_bytes


class BudgetShortfall(RuntimeError):
    """The planned allocations exceed the device's free memory; the message names device and bytes."""

    def __init__(self, budget: "MemoryBudget") -> None:
        self.budget = budget
        parts = ", ".join(f"{name} {format_bytes(num)}" for name, num in budget.items() if num)
        super().__init__(
            f"{budget.service} on {budget.device}: needs {format_bytes(budget.needed_bytes)} ({parts}) but only "
            f"{format_bytes(budget.free_bytes)} is free; short by {format_bytes(-budget.headroom_bytes)}"
        )


@dataclass(frozen=True)
class MemoryBudget:
    """Planned bytes on one device. `expert_bytes` is the routed experts this worker's placement
    holds (0 on an attention worker); `load_peak_bytes` what loading needs on top for a while;
    `reserve_bytes` a margin for allocator fragmentation."""

    service: str
    device: str
    free_bytes: int
    weights_bytes: int = 0
    kv_pool_bytes: int = 0
    activation_bytes: int = 0
    graph_bytes: int = 0
    expert_bytes: int = 0
    load_peak_bytes: int = 0  # transient while loading (a restacked layer, one matrix's conversion)
    reserve_bytes: int = 0

    def __post_init__(self) -> None:
        for name, value in (("free_bytes", self.free_bytes), *self.items()):
            if value < 0:
                raise ValueError(f"{self.device}: {name}={value} is negative")

    def items(self) -> tuple[tuple[str, int], ...]:
        return (
            ("weights", self.weights_bytes),
            ("kv pools", self.kv_pool_bytes),
            ("activations", self.activation_bytes),
            ("graphs", self.graph_bytes),
            ("experts", self.expert_bytes),
            ("loading", self.load_peak_bytes),
            ("reserve", self.reserve_bytes),
        )

    @property
    def needed_bytes(self) -> int:
        return sum(value for _, value in self.items())

    @property
    def headroom_bytes(self) -> int:
        """Free memory left after every planned allocation; negative when it does not fit."""
        return self.free_bytes - self.needed_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def report_lines(self) -> list[str]:
        lines = [f"memory budget of {self.service} on {self.device}:"]
        lines += [f"  {name:<12}{format_bytes(value):>13}" for name, value in self.items()]
        lines.append(f"  {'total':<12}{format_bytes(self.needed_bytes):>13}")
        lines.append(f"  {'free':<12}{format_bytes(self.free_bytes):>13}")
        verdict = "left" if self.fits else "SHORT"
        lines.append(f"  {verdict:<12}{format_bytes(abs(self.headroom_bytes)):>13}")
        return lines

    def log_fields(self) -> dict[str, int | str | bool]:
        fields: dict[str, int | str | bool] = {"device": self.device, "free_bytes": self.free_bytes}
        fields.update({f"{name.replace(' ', '_')}_bytes": value for name, value in self.items()})
        fields.update(needed_bytes=self.needed_bytes, headroom_bytes=self.headroom_bytes, fits=self.fits)
        return fields

    def check(self) -> None:
        """Raise BudgetShortfall unless everything fits."""
        if not self.fits:
            raise BudgetShortfall(self)


def report_and_check(budget: MemoryBudget, logger=None) -> None:
    """Log `<service>.memory_budget` (structlog) with every item, then fail fast if it does not fit."""
    if logger is None:
        import structlog

        logger = structlog.get_logger(budget.service)
    event = f"{budget.service}.memory_budget"
    if budget.fits:
        logger.info(event, **budget.log_fields())
    else:
        logger.error(event, **budget.log_fields())
    budget.check()


def check_all(budgets: list[MemoryBudget]) -> None:
    """Check several devices at once (e.g. `moemesh serve` before it starts workers); the error
    lists every device that does not fit, not only the first."""
    failures = [BudgetShortfall(budget) for budget in budgets if not budget.fits]
    if len(failures) == 1:
        raise failures[0]
    if failures:
        error = BudgetShortfall(failures[0].budget)
        error.args = ("; ".join(str(f) for f in failures),)
        raise error
