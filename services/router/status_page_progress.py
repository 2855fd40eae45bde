"""How many bytes each service is expected to read while it loads the model, so that loading
progress can be shown as a fraction (the status page's bars, `moemesh serve`'s progress line).

The reader reports bytes and tensors read so far (common.runtime.load_progress); the total is
not known to it, because each service reads a different part of one checkpoint. The part is
known from the model's config and the placement, through the checkpoint inventory
(common.model.inventory, torch-free): an attention worker reads every attention-side
tensor (not a routed expert, not `mtp.*`), an expert worker the routed experts of its
(layer, expert) pairs, the draft worker the `mtp.*` blocks. Sizes are the stored entries'
bytes (quantized weights with their scales), which is what the reader counts.

Invariants and reasons:
- An expectation is an estimate for display only: a loader that reads a little more (a shared
  tensor) or less must never break anything, so fractions are clamped to [0, 1] and a finished
  load always shows as complete, whatever its count.
- Nothing here touches the weights: only `config.json` is read (once per model directory).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LoadSizes:
    """Stored bytes per part of one checkpoint. expert_pair_bytes: (layer, expert) -> bytes."""

    attention_bytes: int
    draft_bytes: int
    expert_pair_bytes: Mapping[tuple[int, int], int]
    num_layers: int
    num_experts: int

    def expert_bytes(self, pairs: Iterable[tuple[int, int]]) -> int:
        return sum(self.expert_pair_bytes.get((int(layer), int(expert)), 0) for layer, expert in set(pairs))

    def expected_for(self, role: str, name: str, placement: Mapping[str, Mapping[int, Iterable[int]]]) -> int | None:
        """Bytes service `name` of `role` ("attention", "expert", "draft") reads; None when unknown
        (an expert worker the placement does not name). An attention worker also reads the experts it holds."""
        if role == "draft":
            return self.draft_bytes
        if role == "attention" and name not in placement:
            return self.attention_bytes
        if name in placement:
            layers = placement[name]
            held = self.expert_bytes((layer, expert) for layer, experts in layers.items() for expert in experts)
            return held + (self.attention_bytes if role == "attention" else 0)
        return None


def load_sizes_for_config(config: Any) -> LoadSizes:
    """From a `common.model.config.ModelConfig`."""
    from moemesh.common.model.inventory import tensor_inventory

    attention_bytes = draft_bytes = 0
    pair_bytes: dict[tuple[int, int], int] = {}
    for spec in tensor_inventory(config).values():
        if spec.is_mtp:  # the drafter's blocks, their own routed experts included
            draft_bytes += spec.num_bytes
        elif spec.is_routed_expert:
            key = (spec.layer, spec.expert)
            pair_bytes[key] = pair_bytes.get(key, 0) + spec.num_bytes
        else:
            attention_bytes += spec.num_bytes
    return LoadSizes(attention_bytes, draft_bytes, pair_bytes, config.num_hidden_layers, config.n_routed_experts)


@functools.lru_cache(maxsize=4)
def load_sizes(model_dir: str) -> LoadSizes:
    """The sizes of the checkpoint in `model_dir` (its config.json); cached per directory."""
    from moemesh.common.model.config import ModelConfig

    return load_sizes_for_config(ModelConfig.load(Path(model_dir)))


def with_expected(records: list[dict], sizes: LoadSizes | None,
                  placement: Mapping[str, Mapping[int, Iterable[int]]]) -> list[dict]:
    """The progress records with `num_bytes_expected` (or None) and `fraction` in [0, 1] (or None:
    not known and not done) added; done records are complete."""
    out = []
    for record in records:
        expected = sizes.expected_for(str(record.get("role")), str(record.get("name")), placement) if sizes else None
        fraction = None
        if record.get("done"):
            fraction = 1.0
        elif expected:
            fraction = min(1.0, max(0.0, float(record.get("num_bytes", 0)) / expected))
        out.append({**record, "num_bytes_expected": expected, "fraction": fraction})
    return out


def expected_bytes_for_deployment(deployment: Any) -> dict[str, int]:
    """Service name -> bytes it is expected to read, for a `common.runtime.deployment.Deployment`
    (what `moemesh serve`'s progress line divides by). Workers whose share is unknown are left out."""
    from moemesh.common.placement.worker_holdings import holdings_for  # torch-free

    sizes = load_sizes(str(deployment.model.path))
    in_attention = sizes.draft_bytes if deployment.draft.in_attention else 0  # a drafter in its process
    expected = {worker.name: sizes.attention_bytes + in_attention + sizes.expert_bytes(
        holdings_for(worker.name, worker.placement, sizes.num_layers, sizes.num_experts).held)
        for worker in deployment.attention}  # plus the routed experts it holds itself
    for worker in deployment.expert:
        held = holdings_for(worker.name, worker.placement, sizes.num_layers, sizes.num_experts).held
        expected[worker.name] = sizes.expert_bytes(held)
    if deployment.draft.runs_process:
        expected[deployment.draft.name] = sizes.draft_bytes
    return expected
