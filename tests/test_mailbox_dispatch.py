"""Expert workers on the CPU reached through host-memory mailboxes (`data_plane = "mailbox"`) on the serving path.

A tiny FP4 checkpoint; an in-process attention worker (CPU, fp32) against one or two expert worker
processes whose native loops serve the mailboxes, driven by the router's scheduler: tokens equal the
single-process reference, logits equal the ZeroMQ run's bit for bit (the same FP4 kernel, the same slot
order), no Dispatch travels over ZeroMQ once the mailboxes are attached, and a layer split between the
attention worker's own experts and a mailbox worker equals the reference. A worker frozen with SIGSTOP
mid-run is named after the mailbox timeout instead of hanging the step; thawed, it is readmitted and
the run completes; never thawed, the step fails with that cause.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from moemesh.common.placement.worker_holdings import all_pairs
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.mailbox_plane import MailboxConfig
from moemesh.services.attention.recovery import RecoveryConfig
from attention_worker_support import attention_worker, reference_tokens, run_offline, tiny_fp4_checkpoint

PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]
GREEDY = SamplingParams(max_tokens=6)
NAME = "attention-mailbox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_fp4_checkpoint(tmp_path_factory.mktemp("mailbox_ckpt"), seed=23)


@pytest.fixture(scope="module")
def experts(checkpoint, tmp_path_factory):
    """Two CPU expert worker processes, each holding every expert; each test's placement picks their share."""
    path, _ = checkpoint
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("experts")), num_expert_workers=2,
                       placement="all", with_attention=False)
    with LocalCluster(spec) as cluster:
        yield cluster


def _pairs(config, keep):
    return tuple(p for p in all_pairs(config.num_hidden_layers, config.n_routed_experts) if keep(p))


def _worker(checkpoint, experts, open_workers, shares, local=None, **options):
    """shares: per expert process, the pairs it computes (primary, no replicas); local: pairs held here."""
    worker = attention_worker(checkpoint[0], experts, [(share, ()) for share in shares], local, NAME, **options)
    open_workers.append(worker)
    return worker


def test_mailbox_runs_equal_the_reference_and_the_zeromq_run(checkpoint, experts, open_workers):
    path, config = checkpoint
    reference = reference_tokens(path, config, PROMPTS, GREEDY.max_tokens)
    by_layer = (_pairs(config, lambda p: p[0] % 2 == 0), _pairs(config, lambda p: p[0] % 2 == 1))
    by_expert = (_pairs(config, lambda p: p[1] % 2 == 0), _pairs(config, lambda p: p[1] % 2 == 1))
    for shares, workers_per_layer in ((by_layer, 1), (by_expert, 2)):
        zmq = _worker(checkpoint, experts, open_workers, shares, data_plane="zmq")
        zmq_counters, counters = [], []
        want_tokens, want_logits = run_offline(zmq, PROMPTS, GREEDY, counters=zmq_counters)
        worker = _worker(checkpoint, experts, open_workers, shares, data_plane="mailbox")
        tokens, logits = run_offline(worker, PROMPTS, GREEDY, counters=counters)
        # the step counters the router adds up: ZeroMQ messages for layers, none through the mailboxes
        decode, zmq_decode = [c for c in counters if c.decode], [c for c in zmq_counters if c.decode]
        assert decode and len(decode) == len(zmq_decode)
        assert all(c.data_messages == config.num_hidden_layers * workers_per_layer for c in zmq_decode)
        assert all(c.data_messages == 0 and c.host_syncs == -1 for c in decode)  # CPU: syncs not counted
        assert tokens == want_tokens == reference
        assert len(logits) == len(want_logits)  # same placement, same sums in the same order: bit for bit
        assert all(a is None and b is None or bool((a == b).all()) for a, b in zip(logits, want_logits))
        plane = worker.dispatcher.mailbox_plane
        assert plane is not None and sorted(plane._boxes) == [0, 1]  # both workers took a mailbox
        num_steps = sum(row is not None for row in logits)
        assert plane.num_layers_posted == num_steps * config.num_hidden_layers * workers_per_layer


def test_a_layer_split_with_the_attention_workers_own_experts(checkpoint, experts, open_workers):
    path, config = checkpoint
    remote = (_pairs(config, lambda p: p[1] % 2 == 1), ())  # the second process computes nothing
    local = _pairs(config, lambda p: p[1] % 2 == 0)
    worker = _worker(checkpoint, experts, open_workers, remote, local=local, data_plane="mailbox")
    tokens, _ = run_offline(worker, PROMPTS, GREEDY)
    assert tokens == reference_tokens(path, config, PROMPTS, GREEDY.max_tokens)
    dispatcher = worker.dispatcher
    assert dispatcher.mailbox_plane.num_layers_posted > 0
    assert dispatcher.num_slot_tokens_sent[dispatcher.local_index] > 0 and dispatcher.num_slot_tokens_sent[0] > 0


@pytest.mark.parametrize("thaw_after_s", [2.5, None])
def test_a_frozen_mailbox_worker_is_detected_and_the_step_recovers_or_fails(checkpoint, tmp_path, open_workers,
                                                                          thaw_after_s):
    """SIGSTOP at step 2: the layer's wait ends after the mailbox timeout (1 s) naming the worker; thawed
    within the recovery budget, the worker is readmitted, takes a new mailbox and the run completes with
    the reference tokens; never thawed, the step fails with that cause once the budget is spent."""
    path, config = checkpoint
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path / "run"), num_expert_workers=1, placement="all",
                       with_attention=False)
    with LocalCluster(spec) as cluster:
        worker = _worker(checkpoint, cluster, open_workers, (_pairs(config, lambda p: True),), data_plane="mailbox",
                         mailbox=MailboxConfig(timeout_s=1.0), recovery=RecoveryConfig(budget_s=6.0))
        pid = cluster.processes["expert-0"].pid
        frozen = {}

        def freeze_at_step_two(num_steps: int) -> None:
            if num_steps == 2:
                os.kill(pid, signal.SIGSTOP)
                frozen["at_s"] = time.monotonic()
                if thaw_after_s is not None:
                    threading.Timer(thaw_after_s, os.kill, (pid, signal.SIGCONT)).start()

        try:
            if thaw_after_s is not None:
                tokens, _ = run_offline(worker, PROMPTS, GREEDY, freeze_at_step_two)
            else:
                with pytest.raises(AssertionError) as failure:  # run_offline: every request ends without error
                    run_offline(worker, PROMPTS, GREEDY, freeze_at_step_two)
        finally:
            os.kill(pid, signal.SIGCONT)
        elapsed_s = time.monotonic() - frozen["at_s"]
    recovery = worker.recovery
    if thaw_after_s is not None:
        assert tokens == reference_tokens(path, config, PROMPTS, GREEDY.max_tokens)
        assert recovery.num_recovered_steps >= 1 and recovery.num_failed_steps == 0
        assert worker.dispatcher.mailbox_plane._boxes  # a new mailbox after the readmission
    else:
        text = str(failure.value)
        # the layer it stops at depends on when SIGSTOP lands: between steps (layer 0) or inside the next one
        assert "expert worker 0" in text and re.search(r"mailbox: layer \d+: no answer within 1\.0 s", text), text
        assert recovery.num_failed_steps >= 1
        assert elapsed_s < 6.0 + 5.0  # the recovery budget, not a hang
