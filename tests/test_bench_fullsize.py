"""bench.fullsize: the split run (attention worker + two expert worker processes loading a random
checkpoint) equals the in-process reference; the pieces it is built from do what they say.

The end-to-end test runs `python -m moemesh.bench.fullsize --tiny` (4 layers, CPU) and checks its JSON: the
pair check passed, the greedy tokens of every run equal the single-process run's on the same checkpoint
and the chosen-token logprobs agree within bench/fullsize_reference.py's tolerance, both routings ran,
the context prefill routed "near" touched no far expert, skewed routing sends more of the routed slots
to the near worker than uniform does, and every figure the report needs is there. The pair-check test starts real expert workers and an attention worker that
believes one pair lives elsewhere: the check names that pair, and the Dispatch the worker then
refuses is explained as "sent wrong". The unit tests check the CPU FP4 path against the reference
dequantisation and (with CUDA) the GPU kernel path against the CPU one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moemesh.common.model.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]


def _tiny_config(num_layers: int = 4) -> ModelConfig:
    from moemesh.bench.fullsize_setup import model_hub_dict

    return ModelConfig.from_dict(model_hub_dict(num_layers, tiny=True))


def test_cpu_fp4_linear_equals_reference_dequantisation():
    from moemesh.common.kernels.reference import dequant_fp4
    from moemesh.common.model.random_init import random_fp4_stack
    from moemesh.common.model.cpu_experts import fp4_linear_blocked

    generator = torch.Generator().manual_seed(3)
    packed, scale = random_fp4_stack(1, 96, 128, generator=generator)
    x = torch.randn(5, 128, generator=generator)
    expected = torch.nn.functional.linear(x, dequant_fp4(packed[0], scale[0]))
    for block_rows in (7, 32, 256):  # ragged, exact and single blocks
        got = fp4_linear_blocked(x, packed[0], scale[0], block_rows=block_rows)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_skew_concentrates_on_low_ranks():
    from moemesh.bench.fullsize_setup import plan_split

    config = _tiny_config(4)
    from moemesh.common.placement.cost import ModelCosts

    budget = 8 * 4 * ModelCosts.from_config(config).bytes_per_expert
    plan = plan_split(config, "cpu", "cpu", budget, seed=0)
    assert plan.num_near_experts == 32 and plan.num_far_experts == 32
    assert plan.expected_near_share > 0.5  # the favoured half of every learned layer is near


def test_fullsize_tiny_split_equals_in_process(tmp_path):
    out_dir = tmp_path / "out"
    command = [sys.executable, "-m", "moemesh.bench.fullsize", "--tiny", "--layers", "4", "--batch", "3",
               "--routing", "uniform,skewed", "--skew", "1.0", "--decode-steps", "3", "--warmup-steps", "1",
               "--context", "6", "--context-routing", "near", "--out-dir", str(out_dir),
               "--run-dir", str(tmp_path / "run"), "--checkpoint-cache", str(tmp_path / "checkpoints")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = out_dir.glob("fullsize-*-2*.json")  # not fullsize-partial.json
    raw = json.loads(path.read_text())["raw"]
    assert raw["pair_check"]["ok"] and raw["pair_check"]["num_pairs"] == 4 * 16
    assert raw["context_method"]["routing"] == "near"
    check = raw["reference_check"]
    assert check["ok"] and len(check["runs"]) == 2
    assert all(run["tokens_equal"] and run["num_tokens"] > 0 for run in check["runs"])
    assert all(run["max_abs_logprob_diff"] <= 1e-4 for run in check["runs"])
    assert raw["checkpoint"].startswith(str(tmp_path / "checkpoints"))
    runs = {(r["routing"], r["batch"]): r for r in raw["decode"]}
    assert set(runs) == {("uniform", 3), ("skewed", 3)}
    for run in runs.values():
        s = run["summary"]
        assert s["num_steps"] == 3 and s["step_s"] > 0 and s["floor_s"] > 0
        assert s["near_expert_s"] > 0 and s["far_expert_s"] >= 0 and s["wait_s"] > 0
        assert abs(s["near_slot_share"] + s["far_slot_share"] - 1) < 1e-9
        assert not s["layers_with_wrong_slot_count"]
        assert s["num_routed_slots"] == s["expected_routed_slots"] == 3 * run["batch"] * 4 * 2  # steps B layers k
        # the context (3 x 6 tokens) went to the near worker only: every slot of every layer
        assert run["context_routed_slots"] == {"expert-near": 3 * 6 * 4 * 2, "expert-far": 0}
    skewed_share = runs[("skewed", 3)]["summary"]["near_slot_share"]
    # layers 0-2 are hash-routed (as in V4-Flash: uniform whatever the bias); layer 3 is learned and
    # strongly skewed towards the near worker's experts
    assert skewed_share > runs[("uniform", 3)]["summary"]["near_slot_share"] + 0.1
    assert raw["placement"]["num_near_experts"] + raw["placement"]["num_far_experts"] == 4 * 16


def test_check_pairs_names_the_first_broken_pair():
    from moemesh.bench.fullsize_verify import PairVerificationError, check_pairs

    planned = {"near": {(0, 0), (0, 1)}, "far": {(0, 2), (0, 3)}}
    holders = [[(0,), (0,), (1,), (1,)]]
    args = dict(worker_names=["near", "far"], router_holders=holders, down_workers=set(),
                device_owner=[[0, 0, 1, 1]], num_layers=1, num_experts=4)
    assert check_pairs(planned, planned, **args)["ok"]
    with pytest.raises(PairVerificationError, match=r"layer 0, expert 1\) is planned on near"):
        check_pairs(planned, {"near": {(0, 0)}, "far": {(0, 2), (0, 3)}}, **args)  # near dropped one
    with pytest.raises(PairVerificationError, match=r"layer 0, expert 2\) is held by \['near', 'far'\]"):
        check_pairs(planned, {"near": {(0, 0), (0, 1), (0, 2)}, "far": {(0, 2), (0, 3)}}, **args)
    with pytest.raises(PairVerificationError, match="owner table on the attention device says far"):
        check_pairs(planned, planned, **{**args, "device_owner": [[0, 1, 1, 1]]})
    with pytest.raises(PairVerificationError, match="marked down"):
        check_pairs(planned, planned, **{**args, "down_workers": {1}})


def test_pair_check_and_refusal_explained_with_live_workers(tmp_path):
    """Expert workers load the plan; an attention worker that routes one far pair to the near worker is
    caught by the pair check, and the Dispatch it then sends is refused and explained as "sent wrong"."""
    import dataclasses

    from moemesh.bench.fullsize_setup import FullsizeCluster, model_hub_dict, plan_split
    from moemesh.bench.fullsize_timing import TimedDispatcher, flush_expert_timings, run_requests
    from moemesh.bench.fullsize_verify import PairVerificationError, explain_refusals, planned_pairs, verify_pairs_served
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.common.runtime.local_cluster import ClusterSpec
    from moemesh.services.attention.recovery import RecoveryConfig
    from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
    from moemesh.bench.random_checkpoint import cached_checkpoint
    from moemesh.common.placement.cost import ModelCosts

    hub = model_hub_dict(2, tiny=True)  # two hash-routed layers: token ids decide the experts
    config = ModelConfig.from_dict(hub)
    model_dir = cached_checkpoint(hub, seed=0, cache_dir=tmp_path / "checkpoints", progress=None)
    plan = plan_split(config, "cpu", "cpu", 16 * ModelCosts.from_config(config).bytes_per_expert, seed=0)
    near, far = plan.placement.workers
    moved = sorted(far.expert_ids)[0]
    wrong = dataclasses.replace(plan, placement=dataclasses.replace(plan.placement, workers=(
        dataclasses.replace(near, expert_ids=tuple(sorted([*near.expert_ids, moved]))),
        dataclasses.replace(far, expert_ids=tuple(p for p in far.expert_ids if p != moved)))))
    spec = ClusterSpec(model_path=str(model_dir), run_dir=str(tmp_path / "run"), ready_timeout_s=60.0)
    cluster = FullsizeCluster(spec, plan, tmp_path / "timing")
    cluster.launch()
    worker = None
    try:
        cluster.wait_ready()
        endpoints = {name: cluster.endpoint_of(name) for name in cluster.expert_names}
        names = list(cluster.expert_names)
        worker = AttentionWorker(AttentionWorkerConfig(
            name="attention-0", checkpoint_path=str(model_dir), expert_endpoints=cluster.endpoints(),
            expert_workers=FullsizeCluster(spec, wrong, tmp_path / "t2").holdings(),
            kv=KVPoolConfig(block_size_tokens=128, num_primary_blocks=4), dispatch_timeout_s=30.0,
            recovery=RecoveryConfig(max_attempts=1)))
        worker.load_now()
        layer, expert = moved
        with pytest.raises(PairVerificationError, match=rf"layer {layer}, expert {expert}\): the attention worker "
                           rf"routes it to \['expert-near'\], the plan to expert-far"):
            verify_pairs_served(worker.runner.dispatcher, plan, endpoints, names)
        with pytest.raises(PairVerificationError, match=rf"layer {layer}, expert {expert}\) is planned on "
                           "expert-near but expert-near does not hold it"):
            verify_pairs_served(worker.runner.dispatcher, wrong, endpoints, names)  # the workers hold `plan`
        table = worker.side.layers[layer].ffn.gate.tid2eid  # [V, K]
        token = int((table == expert).any(dim=1).nonzero()[0, 0])  # a token routed to the moved expert
        dispatcher = TimedDispatcher(worker.runner.dispatcher)
        worker.runner.dispatcher = dispatcher
        flush_expert_timings(endpoints, cluster.timing_dir)
        with pytest.raises(Exception, match="not_found"):
            run_requests(worker, [[token]], 1, block_size_tokens=128, num_primary_blocks=4, max_batched_tokens=8)
        explained = explain_refusals(dispatcher.trace, flush_expert_timings(endpoints, cluster.timing_dir), names,
                                     planned_pairs(plan))
        assert explained and explained[0]["worker"] == "expert-near", explained
        assert explained[0]["verdict"].startswith(f"sent wrong: the mask selects experts [{expert}]"), explained
        assert explained[0]["sent"]["expert_ids"] == explained[0]["received"]["expert_ids"]
    finally:
        if worker is not None:
            import asyncio

            asyncio.run(worker.close())
        cluster.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_expert_worker_path_matches_cpu_path():
    """The expert worker's kernel path (CUDA, bf16) against the CPU path on the same bytes."""
    from moemesh.common.model.random_init import flash_config
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.quantized_experts import QuantizedRoutedExperts
    from moemesh.common.model.cpu_experts import expert_rows
    from moemesh.bench.hostwork import random_held_experts
    from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig

    config = flash_config([AttentionKind.CSA], hidden_size=512, moe_intermediate_size=256, n_routed_experts=32)
    pairs = [(0, e) for e in range(0, 32, 2)]
    cpu = random_held_experts(config, pairs, "cpu", seed=2)
    worker = ExpertWorker(ExpertWorkerConfig(name="gpu", checkpoint_path="", device="cuda"), config)
    layer = cpu._layers[0]  # the same bytes on the GPU (CPU and CUDA generators differ)
    tensors = [getattr(layer, n).cuda() for n in ("w1", "s1", "w2", "s2", "w3", "s3")]
    worker.holdings.adopt(QuantizedRoutedExperts({0: (layer.expert_ids, tensors)}, 32, config.swiglu_limit))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 512, generator=generator)
    ids = torch.stack([torch.randperm(32, generator=generator)[:6] for _ in range(9)]).sort(dim=1).values
    weights = torch.rand(9, 6, generator=generator)
    selected = ids % 2 == 0
    expected = expert_rows(cpu._layers[0], hidden, ids, weights, selected, config.swiglu_limit, False)
    got = worker._slot_outputs(0, hidden.cuda().bfloat16(), ids.cuda(), weights.cuda(), selected.cuda())
    assert bool((got.cpu()[~selected] == 0).all())
    torch.testing.assert_close(got.float().cpu(), expected, rtol=5e-2, atol=5e-2)
