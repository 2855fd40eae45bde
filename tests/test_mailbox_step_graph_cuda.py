"""A decode step on the GPU with part of the routed experts in another process, as one CUDA graph: the
attention worker (embedded default model, bf16, CUDA graphs) holds the even experts itself and reaches an
expert worker process holding the odd ones through a mailbox whose post, wait and combine are GPU kernels:
a CPU worker through host memory (its native loop), or a worker on the same GPU through the attention
worker's device memory (one CUDA graph replay per step on its side; run under MPS by the device script).

Greedy tokens equal the same split reached through ZeroMQ (the worker computes the same rows either way);
with the CPU worker the first steps' logits are those of the run with every expert in the attention worker
(within bf16 rounding: the CPU computes its experts in float32, so a long greedy run may part from the
all-local one at a near tie); every decode step is one replay of a step graph, and the worker served every
layer. A worker frozen with SIGSTOP is named after the mailbox timeout (the wait kernel gives up; the error
word is read after the replay) and, thawed within the recovery budget, takes a new mailbox and the run
completes. Skipped without CUDA.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]
NAME = "attention-mailbox-graph"


@pytest.fixture(scope="module")
def config():
    from moemesh.common.checkpoint.reader import CheckpointReader

    return CheckpointReader(MODEL).config


@pytest.fixture
def cpu_experts(tmp_path):
    from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(model_path=str(MODEL), run_dir=str(tmp_path / "run"), num_expert_workers=1, placement="all",
                       with_attention=False, expert_devices=("cpu",))
    with LocalCluster(spec) as cluster:
        yield cluster


def _pairs(config, keep):
    from moemesh.common.placement.worker_holdings import all_pairs

    return tuple(p for p in all_pairs(config.num_hidden_layers, config.n_routed_experts) if keep(p[1]))


def _run(worker, before_step=lambda num_steps: None):
    from moemesh.common.sampling_params import SamplingParams
    from attention_worker_support import run_offline

    return run_offline(worker, PROMPTS, SamplingParams(max_tokens=10), before_step)


def _split_worker(config, cpu_experts, open_workers, data_plane="mailbox", **options):
    from moemesh.services.attention.mailbox_plane import MailboxConfig
    from attention_worker_support import attention_worker

    if data_plane == "mailbox":
        options = {"mailbox": MailboxConfig(timeout_s=1.0), **options}
    worker = attention_worker(MODEL, cpu_experts, [(_pairs(config, lambda e: e % 2 == 1), ())],
                              _pairs(config, lambda e: e % 2 == 0), NAME, device="cuda", cuda_graphs=True,
                              data_plane=data_plane, **options)
    open_workers.append(worker)
    return worker


def _assert_logits_close(got_logits, want_logits):
    for got, want in zip(got_logits, want_logits, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            assert float((got - want).norm() / want.norm()) < 2e-2


def _split_equals_zmq(config, experts, open_workers):
    """The split through mailboxes against the same split over ZeroMQ: tokens equal, logits within bf16
    rounding, every decode step one replay of a step graph -> (the mailbox worker, its logits)."""
    zmq_tokens, zmq_logits = _run(_split_worker(config, experts, open_workers, data_plane="zmq"))
    split = _split_worker(config, experts, open_workers)
    assert split.dispatcher.device_step_ready(1)
    got_tokens, got_logits = _run(split)
    assert got_tokens == zmq_tokens
    _assert_logits_close(got_logits, zmq_logits)
    stats = split.runner.graphs.stats
    assert stats.num_step_graph_steps > 0 and stats.num_step_graph_steps == stats.num_graph_steps
    return split, got_logits


def test_split_step_graph_matches_the_zmq_split_and_the_all_local_run(config, cpu_experts, open_workers):
    from attention_worker_support import attention_worker

    local = attention_worker(MODEL, cpu_experts, None, _pairs(config, lambda e: True), NAME, device="cuda",
                             cuda_graphs=True)
    open_workers.append(local)
    local_tokens, local_logits = _run(local)
    split, got_logits = _split_equals_zmq(config, cpu_experts, open_workers)
    _assert_logits_close(got_logits[:2], local_logits[:2])  # the prefill step and the first decode step
    stats = split.runner.graphs.stats
    plane = split.dispatcher.mailbox_plane
    assert list(plane._boxes) == [0] and plane._boxes[0].gpu is not None
    served = plane._boxes[0].segment.word(_word("SERVED"))
    assert served >= stats.num_step_graph_steps * config.num_hidden_layers  # the native loop ran every layer


def _word(name: str):
    from moemesh.common.kernels.mailbox_layout import Word

    return Word[name]


@pytest.mark.parametrize("where", ["cpu_experts", "gpu_experts"])
def test_a_frozen_worker_fails_the_replay_and_the_run_recovers(config, where, request, open_workers):
    """Frozen at step four (SIGSTOP), thawed 2.5 s later: the replay's wait times out (1 s), the step is rolled
    back and retried once the worker takes a new mailbox, and the run equals an undisturbed split run."""
    from moemesh.common.sampling_params import SamplingParams
    from moemesh.services.attention.recovery import RecoveryConfig
    from attention_worker_support import run_offline

    experts = request.getfixturevalue(where)
    split = _split_worker(config, experts, open_workers, recovery=RecoveryConfig(budget_s=8.0))
    pid = experts.processes["expert-0"].pid

    def freeze_at_step_four(num_steps: int) -> None:
        if num_steps == 4:
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(2.5, os.kill, (pid, signal.SIGCONT)).start()

    try:
        tokens, _ = run_offline(split, PROMPTS, SamplingParams(max_tokens=10), freeze_at_step_four)
    finally:
        os.kill(pid, signal.SIGCONT)
    reference, _ = _run(_split_worker(config, experts, open_workers))
    assert tokens == reference
    assert split.recovery.num_recovered_steps >= 1 and split.recovery.num_failed_steps == 0


@pytest.fixture
def gpu_experts(tmp_path):
    from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(model_path=str(MODEL), run_dir=str(tmp_path / "run-gpu"), num_expert_workers=1,
                       placement="all", with_attention=False, expert_devices=("cuda",))
    with LocalCluster(spec) as cluster:
        yield cluster


def test_gpu_expert_worker_serves_the_step_graph_through_a_device_mailbox(config, gpu_experts, open_workers):
    """An expert worker on the attention worker's GPU (MPS where the device script starts it) maps the mailbox
    from the attention worker's device memory and replays one graph per step: tokens equal the same split over
    ZeroMQ, every decode step is one replay, and the worker answered every layer of it."""
    split, _ = _split_equals_zmq(config, gpu_experts, open_workers)
    stats = split.runner.graphs.stats
    box = split.dispatcher.mailbox_plane._boxes[0]
    assert box.on_device and box.gpu.device_region is not None
    launched = box.segment.word(_word("SERVED"))  # layers the worker's replays covered
    assert launched >= stats.num_step_graph_steps * config.num_hidden_layers
