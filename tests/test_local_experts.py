"""Routed experts held by the attention worker itself (`[[attention]] placement`), against the reference.

A tiny FP8/FP4 checkpoint with top-4 routing; an in-process attention worker holds every expert, or
half of them with one expert worker process holding the rest, or every expert with a replica in the
expert worker. Tokens equal the single-process reference's; in placement-invariant mode the logits
equal the all-remote run's bit for bit. A live placement switch moves the local pairs out and back.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.placement.worker_holdings import all_pairs
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import Ack, ExpertKey, PlacementWorker, SwitchPlacement
from moemesh.services.attention.expert_channel import local_endpoint
from moemesh.services.attention.worker import AttentionWorker
from attention_worker_support import attention_worker, reference_tokens, run_offline, tiny_fp4_checkpoint

PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]
GREEDY = SamplingParams(max_tokens=6)
NAME = "attention-test"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_fp4_checkpoint(tmp_path_factory.mktemp("local_ckpt"), seed=21)


@pytest.fixture(scope="module")
def reference_outputs(checkpoint):
    path, config = checkpoint
    return reference_tokens(path, config, PROMPTS, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def expert_process(checkpoint, tmp_path_factory):
    """One expert worker process holding every expert; each test's placement decides what it serves."""
    path, _ = checkpoint
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("experts")), num_expert_workers=1,
                       placement="all", with_attention=False)
    with LocalCluster(spec) as cluster:
        yield cluster
    assert cluster.exit_codes == {name: 0 for name in cluster.expert_names}


def _pairs(config, keep) -> tuple[tuple[int, int], ...]:
    return tuple(p for p in all_pairs(config.num_hidden_layers, config.n_routed_experts) if keep(p[1]))


def _attention(checkpoint, open_workers, cluster, remote, local, **options) -> AttentionWorker:
    """remote: (primary, replicas) pairs of the expert process, or None (no expert worker); local: pairs held here."""
    worker = attention_worker(checkpoint[0], cluster, remote, local, NAME, **options)
    open_workers.append(worker)
    return worker


def _run(worker: AttentionWorker, before_step=lambda num_steps: None):
    """(output tokens per prompt, logits of every step); before_step(steps so far) runs before each step."""
    return run_offline(worker, PROMPTS, GREEDY, before_step)


def _same_logits(a, b) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def test_all_experts_in_the_attention_worker_match_the_reference(checkpoint, open_workers, expert_process,
                                                                 reference_outputs):
    _, config = checkpoint
    worker = _attention(checkpoint, open_workers, expert_process, None, _pairs(config, lambda e: True))
    tokens, _ = _run(worker)
    assert tokens == reference_outputs
    assert worker.channel.num_requests == 0  # nothing left the process
    assert worker.dispatcher.num_slot_tokens_sent[worker.dispatcher.local_index] > 0


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_split_and_all_local_runs_are_bit_identical_to_the_all_remote_run(checkpoint, open_workers, expert_process,
                                                                         reference_outputs, micro_batches):
    _, config = checkpoint
    every, even, odd = (_pairs(config, keep) for keep in (lambda e: True, lambda e: e % 2 == 0, lambda e: e % 2))
    options = dict(placement_invariant=True, num_micro_batches=micro_batches)
    remote = _attention(checkpoint, open_workers, expert_process, (every, ()), None, **options)
    split = _attention(checkpoint, open_workers, expert_process, (odd, ()), even, **options)
    local = _attention(checkpoint, open_workers, expert_process, None, every, **options)
    runs = [_run(worker) for worker in (remote, split, local)]
    assert [tokens for tokens, _ in runs] == [reference_outputs] * 3
    assert _same_logits(runs[0][1], runs[1][1]) and _same_logits(runs[0][1], runs[2][1])
    sent = split.dispatcher.num_slot_tokens_sent
    assert sent[split.dispatcher.local_index] > 0 and sent[0] > 0  # both holders computed their share
    assert split.dispatcher.num_slot_tokens_in_flight == [0, 0]


def test_partial_sums_with_a_remote_replica_of_local_experts(checkpoint, open_workers, expert_process,
                                                              reference_outputs):
    _, config = checkpoint
    every, odd = _pairs(config, lambda e: True), _pairs(config, lambda e: e % 2)
    worker = _attention(checkpoint, open_workers, expert_process, ((), odd), every, num_micro_batches=2)
    tokens, _ = _run(worker)
    assert tokens == reference_outputs
    assert worker.dispatcher.slot_owners.router.has_choice(0)  # odd experts have two live copies
    assert worker.recovery.failover.all_answer()  # the local holder always counts as answering


def test_placement_switch_moves_local_pairs_out_and_back(checkpoint, open_workers, expert_process,
                                                         reference_outputs):
    _, config = checkpoint
    every, even, odd = (_pairs(config, keep) for keep in (lambda e: True, lambda e: e % 2 == 0, lambda e: e % 2))
    worker = _attention(checkpoint, open_workers, expert_process, (odd, ()), even)
    remote = PlacementWorker("expert-0", expert_process.endpoint_of("expert-0"),
                             tuple(ExpertKey(layer=l, expert=e) for l, e in every))
    assert isinstance(asyncio.run(worker.handle(SwitchPlacement(placement_version=1, workers=(remote,)))), Ack)
    tokens, _ = _run(worker)
    assert tokens == reference_outputs
    assert worker.dispatcher.num_slot_tokens_sent[worker.dispatcher.local_index] == 0
    back = (PlacementWorker(NAME, local_endpoint(NAME), tuple(ExpertKey(layer=l, expert=e) for l, e in even)),
            PlacementWorker("expert-0", remote.endpoint, tuple(ExpertKey(layer=l, expert=e) for l, e in odd)))
    assert isinstance(asyncio.run(worker.handle(SwitchPlacement(placement_version=2, workers=back))), Ack)
    tokens, _ = _run(worker)
    assert tokens == reference_outputs
    assert worker.dispatcher.num_slot_tokens_sent[worker.dispatcher.local_index] > 0


def test_a_lost_remote_replica_is_retried_on_the_local_copy(checkpoint, open_workers, reference_outputs, tmp_path):
    path, config = checkpoint
    every = _pairs(config, lambda e: True)
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path / "run"), num_expert_workers=1, placement="all",
                       with_attention=False)
    with LocalCluster(spec) as cluster:
        worker = _attention(checkpoint, open_workers, cluster, ((), every), every, dispatch_timeout_s=1.0)

        def kill_at_step_two(num_steps: int) -> None:
            if num_steps == 2:
                cluster.processes["expert-0"].kill()
                cluster.processes["expert-0"].wait(10)

        tokens, _ = _run(worker, kill_at_step_two)
    assert tokens == reference_outputs
    assert worker.recovery.num_replica_retries >= 1 and worker.recovery.num_failed_steps == 0
    assert worker.dispatcher.slot_owners.router.down == {0}  # the expert worker; the local copy served the retry
    assert worker.dispatcher.num_slot_tokens_sent[0] > 0  # the remote copy had carried tokens before


@pytest.mark.parametrize("device, dtype", [
    ("cpu", torch.float32),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_local_slot_outputs_equal_the_expert_workers_bit_for_bit(checkpoint, device, dtype):
    """The attention worker's share, computed on the whole micro-batch with a mask, equals what an expert
    worker answers for the same slots sent as its own rows."""
    from moemesh.services.attention.local_experts import LocalExperts
    from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig
    from moemesh.common.wire.messages import Dispatch

    path, config = checkpoint
    layer, num_tokens, top_k = 1, 11, config.num_experts_per_tok
    even = tuple((layer, e) for e in range(0, config.n_routed_experts, 2))
    local = LocalExperts(torch.device(device), dtype)
    local.load(CheckpointReader(path, config=config), even)
    remote = ExpertWorker(ExpertWorkerConfig(name="expert-even", checkpoint_path=str(path), device=device,
                                             dtype=str(dtype).removeprefix("torch."), pairs=even))
    asyncio.run(remote.load())
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, config.hidden_size, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    route = torch.rand(num_tokens, top_k, generator=generator)
    mask = ids % 2 == 0  # [T, K]
    rows = mask.any(dim=1).nonzero().squeeze(1)  # the tokens an expert worker would get
    ours = local.slot_outputs(layer, x.to(device), ids.to(device), route.to(device), mask.to(device),
                              int(mask.sum())).cpu()  # the slot count, as the dispatcher passes it
    answer = remote.handle_dispatch(Dispatch(dispatch_id=1, step_id=1, layer=layer, micro_batch=0, hidden=x[rows],
                                             expert_ids=ids[rows].int(), weights=route[rows],
                                             per_expert_outputs=True, slot_mask=mask[rows])).output.cpu()
    assert mask.any() and not mask.all()
    assert torch.equal(ours[rows][mask[rows]], answer.to(ours.dtype)[mask[rows]])
    assert not ours[~mask].any()


def test_check_model_counts_the_attention_workers_own_experts(checkpoint, tmp_path):
    from moemesh.common.placement.worker_sizes import worker_rows
    from moemesh.common.runtime.deployment_writer import write_deployment_file

    path, config = checkpoint
    rows = {}
    for placements in (("none", "all"), ("all", "none")):
        table = {"model": {"path": str(path)}, "attention": [{"name": "attention-0", "placement": placements[0]}],
                 "expert": [{"name": "expert-0", "placement": placements[1]}]}
        deployment = write_deployment_file(tmp_path / f"{placements[0]}.toml", table)
        rows[placements[0]] = {row["name"]: row for row in worker_rows(CheckpointReader(path, config=config),
                                                                       deployment_path=str(deployment))}
    remote, local = rows["none"], rows["all"]
    assert local["attention-0"]["num_pairs"] == config.num_hidden_layers * config.n_routed_experts
    assert local["expert-0"]["num_pairs"] == 0 and local["expert-0"]["stored_bytes"] == 0
    for key in ("stored_bytes", "resident_bytes"):
        assert local["attention-0"][key] == remote["attention-0"][key] + remote["expert-0"][key]


_SELECTED_ROWS_SCRIPT = """
import sys, torch
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.model.quantized import KernelBackend
from moemesh.services.attention.local_experts import LocalExperts
reader = CheckpointReader(sys.argv[1])
config = reader.config
layer, top_k = 1, config.num_experts_per_tok
local = LocalExperts(torch.device("cpu"), torch.bfloat16)
local.load(reader, [(layer, e) for e in range(0, config.n_routed_experts, 2)])
local.holdings.experts.backend = KernelBackend.KERNEL
generator = torch.Generator().manual_seed(4)
x = torch.randn(7, config.hidden_size, generator=generator).to(torch.bfloat16)
ids = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[:top_k] for _ in range(7)])
route = torch.rand(7, top_k, generator=generator)
mask = ids % 2 == 0
selected = local.slot_outputs(layer, x, ids, route, mask, int(mask.sum())).float()
every_row = local.slot_outputs(layer, x, ids, route, mask).float()
assert mask.any() and not mask.all() and selected[mask].abs().sum() > 0
assert not selected[~mask].any(), "unselected slots must stay zero"
assert torch.allclose(selected, every_row, rtol=2e-2, atol=2e-2), (selected - every_row).abs().max()
print("ok")
"""


def test_selected_rows_on_the_grouped_kernels_equal_the_every_row_path(checkpoint):
    """The CUDA path of a split layer (only the selected rows through the grouped kernels), on the CPU
    under the Triton interpreter, against the path that computes every slot's row and masks after."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path, _ = checkpoint
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                     os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", _SELECTED_ROWS_SCRIPT, str(path)], capture_output=True, text=True,
                          env=env, timeout=500)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
