"""The expected-time model a placement is judged by.

Per MoE layer and step, T tokens (`tokens_per_step`) each pick K experts. With s[l][e] the share
of layer l's activations that expert e received in the statistics, a token selects e with
probability q = K * s. An expert with h holders (primary + replicas) sends each holder an even
part of its tokens (the dispatcher alternates), so one holder expects n = T * q / h expert-tokens
and is touched at all with probability p = 1 - (1 - q / h)^T. A device d then needs, per layer,

    time(l, d) = max(sum n / tokens_per_s, sum p * bytes_per_expert / bytes_per_s)
                 + hop_s                   if it serves any routed token in layer l
                 + attention_layer_s       if d is the attention device (attention + shared expert)

(the roofline max of compute and weight reads, with whichever rates were measured). Branches run
in parallel, so a layer costs max over d of time(l, d); a placement costs the sum over layers.
The model is deliberately simple: it ranks placements, it does not predict wall-clock exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moemesh.common.placement.devices import DeviceSpec

Shares = Sequence[Sequence[float]]  # [layer][expert], each layer sums to 1


@dataclass(frozen=True)
class ModelCosts:
    """Sizes the planner needs, computed from a ModelConfig (not hard-coded).

    bytes_per_expert: one routed expert's stored bytes (V4-Flash FP4 + scales: 13,369,344).
    attention_bytes_per_layer: mean bytes per layer of everything else in a block (attention,
        compressor, indexer, gate, mHC, shared expert); what the attention device reads per layer.
    """

    num_layers: int
    num_experts: int
    num_experts_per_tok: int
    bytes_per_expert: int
    attention_bytes_per_layer: int

    @classmethod
    def from_config(cls, config) -> "ModelCosts":
        from moemesh.common.model.inventory import tensor_inventory

        expert_bytes: dict[tuple[int, int], int] = {}
        other_bytes = 0
        for spec in tensor_inventory(config).values():
            if spec.layer is None:
                continue
            if spec.expert is None:
                other_bytes += spec.num_bytes
            else:
                key = (spec.layer, spec.expert)
                expert_bytes[key] = expert_bytes.get(key, 0) + spec.num_bytes
        sizes = set(expert_bytes.values())
        if len(sizes) != 1:
            raise ValueError(f"routed experts differ in size ({sorted(sizes)}); the planner assumes one size")
        return cls(
            num_layers=config.num_hidden_layers,
            num_experts=config.n_routed_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            bytes_per_expert=sizes.pop(),
            attention_bytes_per_layer=other_bytes // config.num_hidden_layers,
        )


@dataclass(frozen=True)
class CostConfig:
    """tokens_per_step: T in the model above (a decode batch, or a prefill chunk).
    attention_device: device name of the attention worker; None when it holds no experts' device.
    attention_layer_s: override of the attention device's per-layer attention + shared-expert time;
        None computes it from attention_bytes_per_layer and T shared-expert tokens.
    """

    tokens_per_step: int = 32
    attention_device: str | None = None
    attention_layer_s: float | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_step < 1:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} must be positive")


class CostModel:
    """Evaluates per-(layer, device) times; the planners keep running sums through `LayerLoad`."""

    def __init__(self, costs: ModelCosts, devices: Sequence[DeviceSpec], shares: Shares, config: CostConfig) -> None:
        if len(shares) != costs.num_layers or any(len(row) != costs.num_experts for row in shares):
            raise ValueError(f"shares must be [{costs.num_layers}][{costs.num_experts}]")
        names = [device.name for device in devices]
        if config.attention_device is not None and config.attention_device not in names:
            raise ValueError(f"attention device {config.attention_device} is not one of {', '.join(names)}")
        self.costs = costs
        self.devices = tuple(devices)
        self.config = config
        self.select_prob = [[min(1.0, costs.num_experts_per_tok * s) for s in row] for row in shares]  # q[l][e]
        self.fixed_s = [self._fixed_s(device) for device in self.devices]

    def _fixed_s(self, device: DeviceSpec) -> float:
        if device.name != self.config.attention_device:
            return 0.0
        if self.config.attention_layer_s is not None:
            return self.config.attention_layer_s
        return self.branch_s(device, float(self.config.tokens_per_step), 0.0, self.costs.attention_bytes_per_layer)

    def branch_s(self, device: DeviceSpec, num_expert_tokens: float, num_touched: float, extra_bytes: float = 0.0) -> float:
        """Roofline time for `num_expert_tokens` of compute and `num_touched` expert weight reads."""
        compute = 0.0 if device.expert_tokens_per_s is None else num_expert_tokens / device.expert_tokens_per_s
        memory = 0.0
        if device.bytes_per_s is not None:
            memory = (num_touched * self.costs.bytes_per_expert + extra_bytes) / device.bytes_per_s
        return max(compute, memory)

    def holder_terms(self, layer: int, expert: int, num_holders: int) -> tuple[float, float]:
        """(expected expert-tokens, probability touched) for one holder of (layer, expert)."""
        q = self.select_prob[layer][expert] / num_holders
        tokens = self.config.tokens_per_step
        return tokens * q, 1.0 - (1.0 - q) ** tokens

    def device_rank_s(self, device_index: int) -> float:
        """Time to serve one averagely loaded expert; orders devices from fastest for `hottest`."""
        device = self.devices[device_index]
        mean_tokens = self.config.tokens_per_step * self.costs.num_experts_per_tok / self.costs.num_experts
        return self.branch_s(device, mean_tokens, 1.0)

    def new_layer(self, layer: int) -> "LayerLoad":
        return LayerLoad(self, layer)


class LayerLoad:
    """Running sums for one layer: per device expected tokens, touched experts, loaded experts.

    Invariant: the sums equal those of the experts added minus those removed, each with the
    holder count it was added with (callers remove and re-add an expert when its holders change).
    """

    def __init__(self, model: CostModel, layer: int) -> None:
        num_devices = len(model.devices)
        self.model = model
        self.layer = layer
        self.tokens = [0.0] * num_devices
        self.touched = [0.0] * num_devices
        self.num_loaded = [0] * num_devices  # experts with a nonzero expected load

    def add(self, device_index: int, expert: int, num_holders: int, sign: int = 1) -> None:
        tokens, touched = self.model.holder_terms(self.layer, expert, num_holders)
        self.tokens[device_index] += sign * tokens
        self.touched[device_index] += sign * touched
        if tokens > 0:
            self.num_loaded[device_index] += sign

    def remove(self, device_index: int, expert: int, num_holders: int) -> None:
        self.add(device_index, expert, num_holders, sign=-1)

    def device_s(self, device_index: int) -> float:
        model = self.model
        device = model.devices[device_index]
        time_s = model.fixed_s[device_index]
        if self.num_loaded[device_index] > 0:
            time_s += model.branch_s(device, max(self.tokens[device_index], 0.0), max(self.touched[device_index], 0.0))
            time_s += device.hop_s
        return time_s

    def times(self) -> list[float]:
        return [self.device_s(index) for index in range(len(self.model.devices))]

    def max_s(self) -> float:
        return max(self.times())


@dataclass(frozen=True)
class Evaluation:
    """layer_times_s[l][d]; objective_s = sum over layers of the slowest branch."""

    layer_times_s: tuple[tuple[float, ...], ...]
    objective_s: float
    token_shares: tuple[float, ...]  # per device: fraction of all routed expert-tokens it serves

    def mean_layer_s(self, device_index: int) -> float:
        return sum(row[device_index] for row in self.layer_times_s) / len(self.layer_times_s)


def evaluate(model: CostModel, holders: Sequence[Sequence[Sequence[int]]]) -> Evaluation:
    """Evaluate holders[l][e] = device indices (primary first) under `model`."""
    num_layers = len(holders)
    layer_times = []
    served = [0.0] * len(model.devices)
    for layer in range(num_layers):
        load = model.new_layer(layer)
        for expert, devices in enumerate(holders[layer]):
            for device_index in devices:
                load.add(device_index, expert, len(devices))
                served[device_index] += model.select_prob[layer][expert] / len(devices)
        layer_times.append(tuple(load.times()))
    total = sum(served) or 1.0
    return Evaluation(
        layer_times_s=tuple(layer_times),
        objective_s=sum(max(row) for row in layer_times),
        token_shares=tuple(value / total for value in served),
    )
