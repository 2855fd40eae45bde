"""The placement planner: budgets, hottest-first, replicas, infeasibility, balanced vs hottest."""

from __future__ import annotations

import random

import pytest

from moemesh.common.placement.cost import CostConfig, CostModel, ModelCosts, evaluate
from moemesh.common.placement.devices import DeviceSpec, build_devices
from moemesh.common.placement.placement_file import validate_placement
from moemesh.common.placement.plan import PlacementInfeasible, PlanConfig, Policy, plan_placement
from moemesh.common.model.presets import preset_config
from moemesh.common.placement.stats import Phase, RoutingStats

BYTES = 1_000_000
COSTS = ModelCosts(num_layers=4, num_experts=16, num_experts_per_tok=2, bytes_per_expert=BYTES,
                   attention_bytes_per_layer=0)


def skewed_shares(seed: int = 0, costs: ModelCosts = COSTS) -> list[list[float]]:
    """Pareto-distributed counts per layer, as real routing tends to be, through RoutingStats."""
    rng = random.Random(seed)
    stats = RoutingStats(costs.num_layers, costs.num_experts, costs.num_experts_per_tok)
    for layer in range(costs.num_layers):
        stats.add_counts(Phase.DECODE, layer, [int(100 * rng.paretovariate(1.1)) for _ in range(costs.num_experts)])
    return stats.shares()


def device(name: str, num_experts: int, tokens_per_s: float | None = None, bytes_per_s: float | None = None,
           hop_s: float = 0.0) -> DeviceSpec:
    return DeviceSpec(name, num_experts * BYTES, tokens_per_s, bytes_per_s, hop_s)


def config(policy: Policy, replicas: int = 0, tokens: int = 64, attention: str | None = None) -> PlanConfig:
    return PlanConfig(policy, replicas, CostConfig(tokens_per_step=tokens, attention_device=attention))


def held_counts(result) -> dict[str, int]:
    return {w.device: w.num_held for w in result.placement.workers}


def test_v4_flash_expert_bytes_come_from_the_config():
    costs = ModelCosts.from_config(preset_config("v4-flash"))
    assert costs.bytes_per_expert == 13_369_344  # docs/model.md §8: 13.37 MB per FP4 routed expert with scales
    assert (costs.num_layers, costs.num_experts, costs.num_experts_per_tok) == (43, 256, 6)


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("replicas", [0, 3])
def test_budgets_respected_and_every_expert_placed(policy, replicas):
    devices = [device("cuda:0", 20, bytes_per_s=4e12), device("cuda:1", 30, bytes_per_s=1e12),
               device("cpu", 40, bytes_per_s=1e11)]
    result = plan_placement(COSTS, devices, skewed_shares(), config(policy, replicas))
    validate_placement(result.placement, COSTS.num_layers, COSTS.num_experts, BYTES)
    for spec in devices:
        held = held_counts(result).get(spec.name, 0)
        assert held * BYTES <= spec.budget_bytes, spec.name
    for summary in result.summaries:
        assert summary.num_bytes == (summary.num_experts + summary.num_replicas) * BYTES
        assert summary.num_bytes <= summary.budget_bytes
    assert sum(s.num_experts for s in result.summaries) == COSTS.num_layers * COSTS.num_experts
    assert sum(s.token_share for s in result.summaries) == pytest.approx(1.0)


def test_hottest_experts_go_to_the_fastest_device():
    shares = skewed_shares(1)
    # The slow device is listed first: speed, not order, must decide.
    devices = [device("cpu", 64, bytes_per_s=1e11), device("cuda:0", 24, bytes_per_s=3e12)]
    result = plan_placement(COSTS, devices, shares, config(Policy.HOTTEST))
    gpu = result.placement.worker("expert-cuda0")
    cpu = result.placement.worker("expert-cpu")
    assert len(gpu.expert_ids) == 24  # the fast device is filled to its budget
    coldest_on_gpu = min(shares[l][e] for l, e in gpu.expert_ids)
    hottest_on_cpu = max(shares[l][e] for l, e in cpu.expert_ids)
    assert coldest_on_gpu >= hottest_on_cpu
    top = max(((l, e) for l in range(4) for e in range(16)), key=lambda i: shares[i[0]][i[1]])
    assert top in gpu.expert_ids


def test_replicas_are_counted_in_table_file_and_budget():
    devices = [device("cuda:0", 40, bytes_per_s=3e12), device("cuda:1", 40, bytes_per_s=3e12)]
    shares = skewed_shares(2)
    result = plan_placement(COSTS, devices, shares, config(Policy.HOTTEST, replicas=2))
    holders = result.placement.holders()
    for layer in range(COSTS.num_layers):
        ranked = sorted(range(16), key=lambda e: (-shares[layer][e], e))
        for rank, expert in enumerate(ranked):
            assert len(holders[(layer, expert)]) == (2 if rank < 2 else 1)
    num_replicas = {s.device: s.num_replicas for s in result.summaries}
    assert sum(num_replicas.values()) == 2 * COSTS.num_layers
    assert sum(len(w.replica_ids) for w in result.placement.workers) == 2 * COSTS.num_layers
    assert sum(s.num_bytes for s in result.summaries) == (64 + 8) * BYTES


def test_replicas_only_where_budget_allows():
    devices = [device("cuda:0", 34, bytes_per_s=3e12), device("cpu", 32, bytes_per_s=1e11)]
    result = plan_placement(COSTS, devices, skewed_shares(3), config(Policy.HOTTEST, replicas=4))
    assert sum(s.num_replicas for s in result.summaries) == 2  # 66 slots - 64 experts


def test_infeasible_placement_is_refused_naming_devices_and_shortfall():
    devices = build_devices(["cuda:0=20MB", "cpu=40MB"], ["cuda:0=3000GB/s"])
    with pytest.raises(PlacementInfeasible) as error:
        plan_placement(COSTS, devices, None, config(Policy.BALANCED))
    message = str(error.value)
    assert "cuda:0" in message and "cpu" in message
    assert "64 experts" in message and "hold 60" in message and "short by 4 experts" in message


def test_balanced_beats_hottest_on_its_objective():
    # Two equally fast devices with room for everything: hottest piles every expert on the first,
    # balanced splits each layer's load, so it must be strictly faster.
    devices = [device("cuda:0", 64, tokens_per_s=1e6), device("cuda:1", 64, tokens_per_s=1e6)]
    shares = skewed_shares(4)
    hottest = plan_placement(COSTS, devices, shares, config(Policy.HOTTEST))
    balanced = plan_placement(COSTS, devices, shares, config(Policy.BALANCED))
    assert balanced.evaluation.objective_s < 0.75 * hottest.evaluation.objective_s
    # Its evaluation agrees with an independent evaluation of the written placement.
    model = CostModel(COSTS, devices, shares, CostConfig(tokens_per_step=64))
    index = {"expert-cuda0": 0, "expert-cuda1": 1}
    holders = balanced.placement.holders()
    layout = [[[index[w] for w in holders[(l, e)]] for e in range(16)] for l in range(4)]
    assert evaluate(model, layout).objective_s == pytest.approx(balanced.evaluation.objective_s)


@pytest.mark.parametrize("seed", range(6))
def test_balanced_never_worse_than_hottest(seed):
    rng = random.Random(seed)
    devices = [
        device("cuda:0", rng.randint(10, 40), bytes_per_s=rng.choice([1e12, 3e12]), tokens_per_s=2e6),
        device("cuda:1", rng.randint(10, 30), bytes_per_s=1e12, hop_s=rng.choice([0.0, 5e-5])),
        device("cpu", 64, bytes_per_s=1e11, hop_s=rng.choice([0.0, 3e-4])),
    ]
    shares = skewed_shares(seed + 10)
    for tokens in (1, 32):
        hottest = plan_placement(COSTS, devices, shares, config(Policy.HOTTEST, tokens=tokens, attention="cuda:0"))
        balanced = plan_placement(COSTS, devices, shares, config(Policy.BALANCED, tokens=tokens, attention="cuda:0"))
        assert balanced.evaluation.objective_s <= hottest.evaluation.objective_s * (1 + 1e-12)


def test_balanced_leaves_a_slow_device_unused_when_that_is_faster():
    devices = [device("cuda:0", 64, bytes_per_s=3e12), device("cpu", 64, bytes_per_s=1e11, hop_s=1e-3)]
    result = plan_placement(COSTS, devices, None, config(Policy.BALANCED, attention="cuda:0"))
    assert [w.device for w in result.placement.workers] == ["cuda:0"]
    assert result.summaries[1].num_experts == 0 and result.summaries[1].num_bytes == 0


def test_balanced_replicates_only_when_it_helps():
    # Top-1 routing and one expert with 70 % of every layer: alone it is slower than everything else
    # together, so only splitting it over two devices helps.
    costs = ModelCosts(4, 16, 1, BYTES, attention_bytes_per_layer=0)
    devices = [device("cuda:0", 64, tokens_per_s=1e6), device("cuda:1", 64, tokens_per_s=1e6)]
    shares = [[0.7] + [0.3 / 15] * 15 for _ in range(4)]
    plain = plan_placement(costs, devices, shares, config(Policy.BALANCED))
    replicated = plan_placement(costs, devices, shares, config(Policy.BALANCED, replicas=2))
    assert plain.evaluation.objective_s == pytest.approx(4 * 0.7 * 64 / 1e6)
    assert replicated.evaluation.objective_s < 0.8 * plain.evaluation.objective_s
    holders = replicated.placement.holders()
    assert all(len(holders[(layer, 0)]) == 2 for layer in range(4))
    assert sum(s.num_replicas for s in replicated.summaries) == sum(len(h) - 1 for h in holders.values())


def test_without_statistics_the_plan_is_uniform():
    devices = [device("cuda:0", 32, bytes_per_s=3e12), device("cpu", 32, bytes_per_s=1e11)]
    for policy in Policy:
        result = plan_placement(COSTS, devices, None, config(policy))
        gpu = result.placement.workers[0]
        per_layer = [sum(1 for l, _ in gpu.expert_ids if l == layer) for layer in range(4)]
        assert max(per_layer) - min(per_layer) <= 1, (policy, per_layer)


def test_attention_device_carries_attention_time():
    costs = ModelCosts(4, 16, 2, BYTES, attention_bytes_per_layer=50 * BYTES)
    devices = [device("cuda:0", 64, bytes_per_s=1e12), device("cuda:1", 64, bytes_per_s=1e12)]
    result = plan_placement(costs, devices, None, config(Policy.BALANCED, attention="cuda:0"))
    counts = {s.device: s.num_experts for s in result.summaries}
    assert counts["cuda:1"] > counts["cuda:0"]  # the attention device takes fewer experts
