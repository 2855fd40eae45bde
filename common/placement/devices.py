"""Devices an expert placement can use: memory budget, measured speed, dispatch cost.

Parsed from command-line values such as `cuda:0=80GiB`, `cuda:0=3000GB/s`, `cpu=2e6tok/s`,
`cpu=600` (hop microseconds). Sizes take decimal (KB, MB, GB, TB) or binary (KiB, MiB, GiB, TiB)
units, never a bare letter, so `80G` is refused instead of guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")
_DEVICE_NAME = re.compile(r"^[a-z]+(?::[0-9]+)?$")

# Used only when no --throughput is given for a device; printed as "assumed" next to the plan.
ASSUMED_BYTES_PER_S = {"cuda": 2.0e12, "xpu": 1.0e12, "mps": 4.0e11, "cpu": 5.0e10}


class DeviceSpecError(ValueError):
    """A device argument that cannot be parsed; the message quotes it."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device that may hold routed experts.

    budget_bytes: memory the device may spend on routed experts (not attention weights or KV).
    expert_tokens_per_s: compute-bound rate (token-expert pairs per second), if measured.
    bytes_per_s: weight-read bandwidth, if measured; with both, time is the roofline max.
    hop_s: fixed cost per layer when the device serves any routed token of that layer
        (dispatch + combine round trip); it is why a slow device may best stay empty.
    throughput_assumed: True when neither rate was given and ASSUMED_BYTES_PER_S was used.
    """

    name: str
    budget_bytes: int
    expert_tokens_per_s: float | None = None
    bytes_per_s: float | None = None
    hop_s: float = 0.0
    throughput_assumed: bool = False

    def __post_init__(self) -> None:
        if not _DEVICE_NAME.match(self.name):
            raise DeviceSpecError(f"device {self.name!r} is not like 'cuda:0' or 'cpu'")
        if self.budget_bytes < 0:
            raise DeviceSpecError(f"{self.name}: budget {self.budget_bytes} bytes is negative")
        if self.expert_tokens_per_s is None and self.bytes_per_s is None:
            raise DeviceSpecError(f"{self.name}: needs expert_tokens_per_s or bytes_per_s")
        for rate in (self.expert_tokens_per_s, self.bytes_per_s):
            if rate is not None and rate <= 0:
                raise DeviceSpecError(f"{self.name}: rates must be positive, got {rate}")
        if self.hop_s < 0:
            raise DeviceSpecError(f"{self.name}: hop time {self.hop_s} s is negative")

    @property
    def kind(self) -> str:
        return self.name.split(":")[0]


def parse_size(text: str) -> int:
    """'80GiB' -> 85899345920; '13.37MB' -> 13370000. A unit is required."""
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise DeviceSpecError(f"size {text!r} needs a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_rate(text: str) -> tuple[str, float]:
    """'3000GB/s' -> ('bytes_per_s', 3e12); '2e6tok/s' -> ('expert_tokens_per_s', 2e6)."""
    match = _NUMBER_UNIT.match(text)
    if match:
        value, unit = float(match.group(1)), match.group(2).upper()
        if unit == "TOK/S":
            return "expert_tokens_per_s", value
        if unit.endswith("/S") and unit[:-2] in _SIZE_UNITS:
            return "bytes_per_s", value * _SIZE_UNITS[unit[:-2]]
    raise DeviceSpecError(f"throughput {text!r} needs a unit: tok/s (expert-tokens per second) or GB/s, GiB/s, ...")


def split_assignment(text: str) -> tuple[str, str]:
    """'cuda:0=80GiB' -> ('cuda:0', '80GiB')."""
    device, sep, value = text.partition("=")
    device = device.strip()
    if not sep or not device or not value.strip():
        raise DeviceSpecError(f"{text!r} is not DEVICE=VALUE (e.g. cuda:0=80GiB)")
    if not _DEVICE_NAME.match(device):
        raise DeviceSpecError(f"device {device!r} in {text!r} is not like 'cuda:0' or 'cpu'")
    return device, value.strip()


def build_devices(
    budgets: Iterable[str], throughputs: Iterable[str] = (), hops_us: Iterable[str] = ()
) -> list[DeviceSpec]:
    """DeviceSpecs from `--budget`, `--throughput`, `--hop-us` values, in the order budgets were given.

    A device may get two throughput values (one tok/s, one bandwidth). Throughput or hop values
    for a device without a budget are an error (a typo would otherwise be silently ignored).
    """
    budget_of: dict[str, int] = {}
    for text in budgets:
        device, value = split_assignment(text)
        if device in budget_of:
            raise DeviceSpecError(f"--budget given twice for {device}")
        budget_of[device] = parse_size(value)
    if not budget_of:
        raise DeviceSpecError("at least one --budget DEVICE=SIZE is needed")
    rates: dict[str, dict[str, float]] = {device: {} for device in budget_of}
    for text in throughputs:
        device, value = split_assignment(text)
        if device not in budget_of:
            raise DeviceSpecError(f"--throughput {text!r}: {device} has no --budget")
        field, rate = parse_rate(value)
        if field in rates[device]:
            raise DeviceSpecError(f"--throughput gives {field} twice for {device}")
        rates[device][field] = rate
    hop_of: dict[str, float] = {}
    for text in hops_us:
        device, value = split_assignment(text)
        if device not in budget_of:
            raise DeviceSpecError(f"--hop-us {text!r}: {device} has no --budget")
        try:
            hop_of[device] = float(value) * 1e-6
        except ValueError:
            raise DeviceSpecError(f"--hop-us {text!r}: {value!r} is not a number of microseconds") from None
    devices: list[DeviceSpec] = []
    for device, budget in budget_of.items():
        given = rates[device]
        assumed = not given
        if assumed:
            kind = device.split(":")[0]
            given = {"bytes_per_s": ASSUMED_BYTES_PER_S.get(kind, ASSUMED_BYTES_PER_S["cpu"])}
        devices.append(DeviceSpec(device, budget, given.get("expert_tokens_per_s"), given.get("bytes_per_s"),
                                  hop_of.get(device, 0.0), assumed))
    return devices


def format_bytes(num_bytes: float) -> str:
    """Binary units for memory: '80.00 GiB', '12.75 MiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"
