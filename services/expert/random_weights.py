"""A weight source without a checkpoint: random weights in the checkpoint's formats, for benchmarks.

A "random model" is a directory with the hub `config.json` and `random_weights.json` (this file's
`RandomWeightsSpec`) and no safetensors. Every service that loads weights checks
`is_random_model(path)` and then generates what it owns on its own device instead of reading:
- the attention worker: `services.attention.random_weights.random_attention_side_for`, plus the
  routing skew of the spec as gate biases (`skew_ranks`);
- an expert worker: `build_random_experts` for its (layer, expert) pairs, kept quantized
  (`QuantizedRoutedExperts`) — FP4 e2m1 packed + ue8m0 1x32 scales, or FP8 for `expert_dtype fp8`.

Two ways of filling expert bytes (`ExpertFill`):
- EXACT: each layer's full stack [E, ...] is drawn from a generator seeded by (seed, layer), and the
  held experts are taken from it. Any holder of an expert gets the same bytes, so a split run equals
  an in-process run built with the same function. Costs generating every expert of every held layer
  (fast on a GPU, slow on a CPU at V4-Flash size).
- POOL: one random expert per layer is drawn and copied (broadcast) into every held expert's own
  memory. Every expert still occupies and is read from its own bytes (no aliasing, so caches do not
  flatter the timing), but all experts of a layer hold equal values. For timing only: a 30-40 GB CPU
  share is filled at memory-copy speed instead of random-generation speed.
AUTO picks EXACT on CUDA devices and on the CPU below `_MAX_EXACT_CPU_BYTES`, POOL otherwise.
Legend: E experts (per layer), N out features, K in features.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RANDOM_WEIGHTS_FILE = "random_weights.json"
_MAX_EXACT_CPU_BYTES = 2 << 30  # EXACT on the CPU only while a worker's generated stacks stay this small


class ExpertFill(enum.Enum):
    AUTO = "auto"
    EXACT = "exact"
    POOL = "pool"


@dataclass(frozen=True)
class RandomWeightsSpec:
    """seed: attention side uses `seed`, experts `seed + 1` (per layer); expert_fill: see the module;
    routing_skew: gate bias strength c >= 0 of learned layers, bias[e] = -c·ln(1 + rank[e]) with rank a
    per-layer random permutation (0 = hottest); 0 leaves the random gate bias (near-uniform routing)."""

    seed: int = 0
    expert_fill: ExpertFill = ExpertFill.AUTO
    routing_skew: float = 0.0

    def __post_init__(self) -> None:
        if not self.routing_skew >= 0.0:
            raise ValueError(f"routing_skew={self.routing_skew} must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["expert_fill"] = self.expert_fill.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RandomWeightsSpec":
        known = {"seed", "expert_fill", "routing_skew"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{RANDOM_WEIGHTS_FILE}: unknown keys {unknown}")
        return cls(seed=int(data.get("seed", 0)), expert_fill=ExpertFill(data.get("expert_fill", "auto")),
                   routing_skew=float(data.get("routing_skew", 0.0)))


def is_random_model(path: str | Path) -> bool:
    return (Path(path) / RANDOM_WEIGHTS_FILE).is_file()


def read_random_spec(path: str | Path) -> RandomWeightsSpec:
    return RandomWeightsSpec.from_dict(json.loads((Path(path) / RANDOM_WEIGHTS_FILE).read_text(encoding="utf-8")))


def write_random_model(directory: str | Path, hub_config: dict[str, Any], spec: RandomWeightsSpec) -> Path:
    """Write config.json + random_weights.json into `directory` (created); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hub_config, indent=1) + "\n", encoding="utf-8")
    (directory / RANDOM_WEIGHTS_FILE).write_text(json.dumps(spec.to_dict()) + "\n", encoding="utf-8")
    return directory


def skew_ranks(num_experts: int, layer: int, seed: int) -> list[int]:
    """rank[e] of every expert of `layer` under the skewed gate bias (0 = the most favoured).
    A per-layer permutation, so hot experts are different ids in different layers."""
    import torch

    generator = torch.Generator().manual_seed(10_007 * (seed + 1) + layer)
    order = torch.randperm(num_experts, generator=generator).tolist()  # order[r] = expert of rank r
    ranks = [0] * num_experts
    for rank, expert in enumerate(order):
        ranks[expert] = rank
    return ranks


# ------------------------------------------------------------------------------------ experts
def _layer_seed(spec: RandomWeightsSpec, layer: int) -> int:
    return 1_000_003 * (spec.seed + 1) + layer


def _make_stack(config, num_experts: int, num_out: int, num_in: int, generator, device):
    from common.model.random_init import random_fp4_stack, random_fp8_stack

    make = random_fp8_stack if config.expert_dtype == "fp8" else random_fp4_stack
    return make(num_experts, num_out, num_in, generator=generator, device=device)


def _layer_tensors(config, layer: int, expert_ids: list[int], device, spec: RandomWeightsSpec, fill: ExpertFill):
    """(w1, s1, w2, s2, w3, s3) stacked over `expert_ids` (ascending) of one layer."""
    import torch

    inter, hidden = config.moe_intermediate_size, config.hidden_size
    shapes = ((inter, hidden), (hidden, inter), (inter, hidden))  # w1, w2, w3 as (N, K)
    generator = torch.Generator(device=device).manual_seed(_layer_seed(spec, layer))
    out = []
    if fill is ExpertFill.EXACT:
        index = torch.tensor(expert_ids, dtype=torch.long, device=device)
        for num_out, num_in in shapes:
            w, s = _make_stack(config, config.n_routed_experts, num_out, num_in, generator, device)
            out += [w.index_select(0, index), s.index_select(0, index)]
            del w, s
        return tuple(out)
    for num_out, num_in in shapes:  # POOL: one random expert, broadcast into every held expert's own memory
        w1, s1 = _make_stack(config, 1, num_out, num_in, generator, device)
        for pool in (w1, s1):
            target = torch.empty((len(expert_ids), *pool.shape[1:]), dtype=pool.dtype, device=device)
            target.copy_(pool.expand_as(target))
            out.append(target)
    return tuple(out)


def resolve_fill(spec: RandomWeightsSpec, config, num_pairs: int, device) -> ExpertFill:
    import torch

    if spec.expert_fill is not ExpertFill.AUTO:
        return spec.expert_fill
    if torch.device(device).type != "cpu":
        return ExpertFill.EXACT
    layers_bytes = config.num_hidden_layers * config.n_routed_experts * expert_bytes(config)
    return ExpertFill.EXACT if layers_bytes <= _MAX_EXACT_CPU_BYTES else ExpertFill.POOL


def expert_bytes(config) -> int:
    """Bytes of one routed expert in its checkpoint format (weights + scales)."""
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    if config.expert_dtype == "fp8":
        blocks = -(-inter // 128) * -(-hidden // 128)
        return 3 * (inter * hidden + blocks)
    return 3 * (inter * hidden // 2 + inter * hidden // 32)


def build_random_experts(config, pairs: Iterable[tuple[int, int]], device, spec: RandomWeightsSpec, *,
                         route_weight_before_w2: bool = False, fill: ExpertFill | None = None):
    """A `QuantizedRoutedExperts` holding `pairs` with random weights on `device` (see the module)."""
    import torch

    from common.model.quantized import QuantizedRoutedExperts
    from common.model.quantized import ExpertFormat

    by_layer: dict[int, list[int]] = {}
    for layer, expert in sorted(set((int(l), int(e)) for l, e in pairs)):
        by_layer.setdefault(layer, []).append(expert)
    fill = fill or resolve_fill(spec, config, sum(len(v) for v in by_layer.values()), device)
    layers = {}
    with torch.no_grad():
        for layer, expert_ids in by_layer.items():
            layers[layer] = (expert_ids, _layer_tensors(config, layer, expert_ids, device, spec, fill))
    fmt = ExpertFormat.FP8 if config.expert_dtype == "fp8" else ExpertFormat.FP4
    return QuantizedRoutedExperts(layers, config.n_routed_experts, config.swiglu_limit, expert_format=fmt,
                                  route_weight_before_w2=route_weight_before_w2)
