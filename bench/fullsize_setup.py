"""What `bench.fullsize` runs: the checkpoint's config, the placement, and the expert processes.

- `model_hub_dict`: V4-Flash's hub config (all 43 layers, or the first N for a rehearsal: 2 window,
  then CSA/HCA alternating, 3 hash-routed layers, as the real model), or a tiny model of the same
  structure for the CPU (`--tiny`). No MTP layer. The benchmark writes it as a checkpoint with random
  weights (`bench.random_checkpoint`, cached by arguments) that every service loads from disk.
- `plan_split`: two expert workers, one on the attention device ("near": the GPU holding attention)
  and one on the other device ("far": the CPU or cuda:1), planned by `common.placement.plan` with the
  `hottest` policy under the near device's budget. Shares come from the skew ranks of the gate bias
  (share ∝ 1/(1 + rank); only the order matters to `hottest`), so under skewed routing the favoured
  experts are near; under uniform routing every placement is as good as any other, so the same
  placement serves both routings (one weight generation for the whole run).
- `FullsizeCluster`: `LocalCluster` with this placement, the deployment written here, and expert
  processes started as `python -m moemesh.bench.fullsize_expert` (the moemesh expert worker with per-dispatch
  timing written on request). The attention worker runs in the benchmark's own process. With a
  `DraftProcess` (--speculation drafter) it also starts the DSpark draft worker (`moemesh draft`,
  fixed width) on its device; the checkpoint then carries the DSpark stages and their keys
  (`bench.random_checkpoint.with_dspark`), read by the draft worker as from any checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moemesh.common.placement.placement_file import Placement, WorkerPlacement, write_placement
from moemesh.common.runtime.deployment_writer import write_deployment_file
from moemesh.common.runtime.launcher import stop_services
from moemesh.common.runtime.local_cluster import ClusterError, ClusterSpec, LocalCluster

NEAR_WORKER = "expert-near"
FAR_WORKER = "expert-far"

def model_hub_dict(num_layers: int | None, tiny: bool) -> dict[str, Any]:
    """Hub config.json of the benchmarked model (see the module docstring)."""
    from moemesh.bench.random_checkpoint import hub_config

    return hub_config("tiny" if tiny else "v4-flash", num_layers=num_layers, num_mtp_layers=0)


def skew_shares(config, seed: int) -> list[list[float]]:
    """[layer][expert] expected-share order under the skewed bias: ∝ 1/(1 + rank); hash layers uniform."""
    from moemesh.common.model.config import RouterKind
    from moemesh.bench.random_checkpoint import skew_ranks

    shares = []
    for layer in range(config.num_hidden_layers):
        if config.mlp_layer_types[layer] is RouterKind.HASH:
            shares.append([1.0 / config.n_routed_experts] * config.n_routed_experts)
            continue
        weights = [1.0 / (1 + r) for r in skew_ranks(config.n_routed_experts, layer, seed)]
        total = sum(weights)
        shares.append([w / total for w in weights])
    return shares


@dataclass(frozen=True)
class SplitPlan:
    placement: Placement
    near_device: str
    far_device: str
    num_near_experts: int
    num_far_experts: int
    bytes_per_expert: int
    expected_near_share: float  # of routed (token, slot) pairs under the skewed shares


def plan_split(config, near_device: str, far_device: str, near_budget_bytes: int, seed: int) -> SplitPlan:
    """Hottest experts on the near device within its budget, the rest on the far device."""
    from moemesh.common.placement.cost import CostConfig, ModelCosts
    from moemesh.common.placement.devices import DeviceSpec
    from moemesh.common.placement.plan import PlanConfig, Policy, plan_placement

    costs = ModelCosts.from_config(config)
    total = costs.bytes_per_expert * costs.num_layers * costs.num_experts
    # Planning labels must differ: near is the fast device; far gets a hop cost so it ranks second
    near_label = "cuda:0"
    far_label = "cpu" if far_device == "cpu" else "cuda:1"
    devices = [DeviceSpec(near_label, near_budget_bytes, bytes_per_s=4.3e12),
               DeviceSpec(far_label, total, bytes_per_s=4.0e12 if far_label != "cpu" else 2e11, hop_s=300e-6)]
    shares = skew_shares(config, seed)
    result = plan_placement(costs, devices, shares, PlanConfig(policy=Policy.HOTTEST))
    by_label = {w.device: w for w in result.placement.workers}  # a device that got nothing may be absent
    near = dataclasses.replace(by_label.get(near_label, WorkerPlacement(NEAR_WORKER, near_label, ())),
                               name=NEAR_WORKER, device=near_device)
    far = dataclasses.replace(by_label.get(far_label, WorkerPlacement(FAR_WORKER, far_label, ())),
                              name=FAR_WORKER, device=far_device)
    placement = dataclasses.replace(result.placement, workers=(near, far))
    near_pairs = set(near.expert_ids)
    share = sum(shares[l][e] for l, e in near_pairs) / config.num_hidden_layers
    return SplitPlan(placement, near_device, far_device, len(near.expert_ids), len(far.expert_ids),
                     costs.bytes_per_expert, share)


@dataclass(frozen=True)
class DraftProcess:
    """The draft worker of a speculative run: its device and fixed width (drafts per request and step)."""

    device: str
    width: int
    name: str = "draft"


class FullsizeCluster(LocalCluster):
    """Expert workers of a `SplitPlan` as processes (`bench.fullsize_expert`); no attention process."""

    def __init__(self, spec: ClusterSpec, plan: SplitPlan, timing_dir: Path, cpu_threads: int | None = None,
                 draft: DraftProcess | None = None) -> None:
        super().__init__(spec)
        self.cpu_threads = cpu_threads  # torch threads of a CPU expert worker (None: torch's default)
        self.plan = plan
        self.timing_dir = timing_dir
        self.expert_names = [w.name for w in plan.placement.workers]
        self.draft = draft
        self.draft_error: str | None = None  # why the draft worker did not come up (its runs then fail alone)

    @property
    def draft_endpoint(self) -> str | None:
        return None if self.draft is None or self.draft_error is not None else self.endpoint_of(self.draft.name)

    def wait_ready(self, names=None) -> None:
        """The expert workers as LocalCluster waits for them; then the draft worker, whose failure to
        start is recorded in `draft_error` (and its process stopped) instead of ending the run: the
        plain and oracle runs need no drafter."""
        super().wait_ready(self.expert_names)
        if self.draft is None:
            return
        try:
            super().wait_ready([self.draft.name])
        except ClusterError as error:
            self.draft_error = str(error)[:2000]
            print(f"draft worker did not start: {self.draft_error[:600]}", flush=True)
            stop_services([self.services.pop(self.draft.name)], drain_s=0.0, margin_s=0.0)

    def write_files(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.timing_dir.mkdir(parents=True, exist_ok=True)
        placement_path = self.run_dir / "placement.toml"
        write_placement(placement_path, self.plan.placement)
        table = self.deployment(str(placement_path), {w.name: w.device for w in self.plan.placement.workers})
        if self.draft is not None:
            table["draft"] = {"enabled": True, "name": self.draft.name, "device": self.draft.device}
        return write_deployment_file(self.config_path, table)

    def launch(self) -> None:
        """Start the expert processes and return at once (weights generate while the caller works)."""
        self.write_files()
        threads = ("--cpu-threads", str(self.cpu_threads)) if self.cpu_threads else ()
        try:
            for name in self.expert_names:
                self.start_worker("expert", name, ("--timing-dir", str(self.timing_dir), *threads),
                                  module="moemesh.bench.fullsize_expert")
            if self.draft is not None:
                self.start_worker("draft", self.draft.name, ("--speculation", "fixed", "--spec-width", str(self.draft.width)))
        except BaseException:
            self.stop()
            raise

    def holdings(self):
        from moemesh.common.placement.worker_holdings import WorkerHoldings

        return tuple(WorkerHoldings(w.name, w.expert_ids, w.replica_ids) for w in self.plan.placement.workers)

    def endpoints(self) -> tuple[str, ...]:
        return tuple(self.endpoint_of(name) for name in self.expert_names)


def worker_placement_summary(plan: SplitPlan) -> dict[str, Any]:
    return {"near_device": plan.near_device, "far_device": plan.far_device,
            "num_near_experts": plan.num_near_experts, "num_far_experts": plan.num_far_experts,
            "bytes_per_expert": plan.bytes_per_expert,
            "near_expert_bytes": plan.num_near_experts * plan.bytes_per_expert,
            "far_expert_bytes": plan.num_far_experts * plan.bytes_per_expert,
            "expected_near_share_skewed": plan.expected_near_share}


__all__ = ["FAR_WORKER", "NEAR_WORKER", "DraftProcess", "FullsizeCluster", "SplitPlan", "WorkerPlacement", "model_hub_dict",
           "plan_split", "skew_shares", "worker_placement_summary"]
