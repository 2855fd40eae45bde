"""The GPU waiting side of the expert mailbox (common/kernels/mailbox_gpu.py) against a native CPU worker.

A native worker thread (cpu_mailbox.c, this process) serves random-weight FP4 experts through one
segment registered with CUDA. The GPU side posts each layer's rows, waits for the worker's done
seq and reads the combine region, all inside one CUDA graph per step; the combine must equal the
in-process experts (the same native kernel) bit for bit, on every replay. Faults: a worker that never
answers makes the wait time out, the wait-error line names it, and later waits in the step return at
once; a done seq past the posted one is a protocol error. CUDA and a C compiler are required.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from moemesh.bench.cpu_mailbox_worker import owned_stacks, random_layers
from moemesh.common.kernels.cpu_fp4_build import find_compiler
from moemesh.common.kernels.cpu_mailbox import ExpertMath, MailboxWorker, load_mailbox, owned_local_table
from moemesh.common.kernels.mailbox_driver import InProcessShare
from moemesh.common.kernels.mailbox_layout import CombineMode, MailboxError, MailboxLayout, MailboxSegment, Word, make_seq

COMPILER = find_compiler()
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(COMPILER is None or shutil.which(COMPILER) is None, reason="no C compiler")]

NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER, TOP_K, T_MAX = 3, 8, 64, 32, 3, 8
SEED, LIMIT = 11, 0.75
MATH = ExpertMath(LIMIT)


@pytest.fixture
def gpu_mailbox():
    from moemesh.common.kernels.mailbox_gpu import GpuMailbox, register_host_segment, unregister_host_segment

    device = torch.device("cuda", 0)
    # the default directory (/dev/shm): CUDA registers shared-memory pages; files of some filesystems it refuses
    segment = MailboxSegment.create(MailboxLayout(T_MAX, HIDDEN, TOP_K, False, CombineMode.SLOTS), 0)
    register_host_segment(segment)
    epoch = torch.zeros(1, dtype=torch.int64, device=device)
    step_errors = torch.zeros(1, dtype=torch.int64, device=device)
    mailbox = GpuMailbox(segment, epoch, step_errors, timeout_ns=200_000_000)
    try:
        yield mailbox
    finally:
        torch.cuda.synchronize(device)
        unregister_host_segment(segment)
        segment.close()


def _rows(num_rows: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, HIDDEN, generator=generator)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(num_rows)]).to(torch.int32)
    weights = torch.rand(num_rows, TOP_K, generator=generator)
    return hidden, ids, weights


def test_post_writes_the_slot_and_releases_the_layer_seq(gpu_mailbox):
    from moemesh.common.kernels.mailbox_gpu import advance_epoch

    segment = gpu_mailbox.segment
    hidden, ids, weights = _rows(5, 1)
    advance_epoch(gpu_mailbox.epoch)
    advance_epoch(gpu_mailbox.epoch)
    gpu_mailbox.post(2, hidden.cuda(), ids.cuda(), weights.cuda())
    torch.cuda.synchronize()
    assert segment.word(Word.DISPATCH_SEQ) == make_seq(2, 2)
    assert segment.word(Word.NUM_ROWS) == 5
    assert torch.equal(torch.from_numpy(segment.hidden[:5].copy()), hidden)
    assert torch.equal(torch.from_numpy(segment.ids[:5].copy()), ids)
    assert torch.equal(torch.from_numpy(segment.weights[:5].copy()), weights)


def test_silent_worker_times_out_once_per_step_and_is_named(gpu_mailbox):
    from moemesh.common.kernels.mailbox_gpu import advance_epoch

    segment = gpu_mailbox.segment
    advance_epoch(gpu_mailbox.epoch)
    torch.cuda.synchronize()
    started = time.perf_counter()
    gpu_mailbox.wait(0)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - started
    assert segment.word(Word.WAIT_ERROR) == MailboxError.TIMEOUT
    assert segment.word(Word.WAIT_ERROR_SEQ) == make_seq(1, 0)
    assert segment.word(Word.WAIT_ERROR_SEEN) == 0 and segment.word(Word.WAIT_ERROR_WORKER) == 0
    assert gpu_mailbox.step_errors.tolist() == [1]  # failed in epoch 1
    assert first_s >= 0.2  # the bound was waited out
    started = time.perf_counter()
    gpu_mailbox.wait(1)
    gpu_mailbox.wait(2)
    torch.cuda.synchronize()
    assert time.perf_counter() - started < 0.15  # same step: no second timeout
    assert segment.word(Word.WAIT_ERROR_SEQ) == make_seq(1, 0)


def test_done_seq_past_the_posted_one_is_a_protocol_error(gpu_mailbox):
    from moemesh.common.kernels.mailbox_gpu import advance_epoch

    segment = gpu_mailbox.segment
    load_mailbox().store_release(segment.word_address(Word.DONE_SEQ), make_seq(1, 2))
    advance_epoch(gpu_mailbox.epoch)
    gpu_mailbox.wait(1)
    torch.cuda.synchronize()
    assert segment.word(Word.WAIT_ERROR) == MailboxError.PROTOCOL
    assert segment.word(Word.WAIT_ERROR_SEEN) == make_seq(1, 2)


def test_graph_steps_through_a_native_worker_equal_in_process_experts(gpu_mailbox):
    from moemesh.common.kernels.mailbox_gpu import advance_epoch

    library = load_mailbox()
    layers = random_layers(SEED, NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER)
    owner = torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.int64)
    local = owned_local_table(owner, 0)
    reference = InProcessShare(library.fp4_kernel(), owned_stacks(layers, local), local, MATH, CombineMode.SLOTS)
    num_rows = 4
    device = torch.device("cuda", 0)
    hidden_in = torch.zeros(num_rows, HIDDEN, device=device)
    ids_in = torch.zeros(num_rows, TOP_K, dtype=torch.int32, device=device)
    weights_in = torch.zeros(num_rows, TOP_K, device=device)
    outputs = torch.zeros(NUM_LAYERS, num_rows, TOP_K, HIDDEN, device=device)

    def step() -> None:
        advance_epoch(gpu_mailbox.epoch)
        for layer in range(NUM_LAYERS):
            gpu_mailbox.post(layer, hidden_in, ids_in, weights_in)
            gpu_mailbox.wait(layer)
            gpu_mailbox.combine_into(outputs[layer], num_rows)

    with MailboxWorker(library, gpu_mailbox.segment, owned_stacks(layers, local), local, MATH):
        step()  # compiles the kernels before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for replay in range(3):
            hidden, ids, weights = _rows(num_rows, 100 + replay)
            hidden_in.copy_(hidden)
            ids_in.copy_(ids)
            weights_in.copy_(weights)
            graph.replay()
            torch.cuda.synchronize()
            assert gpu_mailbox.segment.word(Word.WAIT_ERROR) == 0
            for layer in range(NUM_LAYERS):
                expected = reference(layer, hidden, ids, weights)
                assert torch.equal(outputs[layer].cpu(), expected), (replay, layer)
        assert gpu_mailbox.epoch.item() == 4  # the eager step and three replays (capturing runs nothing)
    # the worker is gone: the replay waits out the bound once, names the worker, and returns
    started = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    elapsed_s = time.perf_counter() - started
    segment = gpu_mailbox.segment
    assert segment.word(Word.WAIT_ERROR) == MailboxError.TIMEOUT and segment.word(Word.WAIT_ERROR_WORKER) == 0
    assert segment.word(Word.WAIT_ERROR_SEQ) == make_seq(5, 0)
    assert gpu_mailbox.step_errors.tolist() == [5]
    assert 0.2 <= elapsed_s < 0.5, elapsed_s  # one timeout for the step, not one per layer
