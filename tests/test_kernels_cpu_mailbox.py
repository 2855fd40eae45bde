"""The CPU expert mailbox (cpu_mailbox.c's worker loop in real worker processes) against a CPU stand-in
of the device side (`MailboxDriver`), exact against in-process experts.

Two worker processes serve random-weight FP4 experts (3 layers x 8 experts, D 64, I 32, top-3) through
one segment per (worker, combine mode, owner split); the driver runs decode steps of 3 layers
(h <- h + routed(h), routing from a fixed gate per layer). Per-slot combine: bitwise the in-process
result (the same kernel, slots added in slot order) whatever the split; partial sums: bitwise the
in-process partials added in worker order, and the in-process result when one worker owns a layer.
Faults: a worker that never answers, one frozen (SIGSTOP) whose late answers must not be taken for
new ones, one killed (SIGKILL) mid-step and replaced by a restarted one, a worker's own error words
(bad layer, bad expert id), a segment whose header does not match. Skips without a C compiler.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch

from moemesh.common.kernels.cpu_fp4 import fp4_expert_reference
from moemesh.common.kernels.cpu_fp4_build import find_compiler
from moemesh.common.kernels.cpu_mailbox import ExpertMath, MailboxWorker, WaitConfig, load_mailbox, owned_local_table
from moemesh.common.kernels.mailbox_driver import InProcessShare, MailboxDriver, read_wait_error, wait_until_attached
from moemesh.common.kernels.mailbox_layout import (CombineMode, MailboxError, MailboxLayout, MailboxSegment, Word,
                                           make_seq, split_seq)
from moemesh.bench.cpu_mailbox_worker import WorkerSpec, owned_stacks, random_layers, spawn_worker
from moemesh.common.kernels.moe_layout import sum_slots_in_order

COMPILER = find_compiler()
pytestmark = pytest.mark.skipif(COMPILER is None or shutil.which(COMPILER) is None, reason="no C compiler")

NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER, TOP_K, T_MAX = 3, 8, 64, 32, 3, 8
SEED, LIMIT = 11, 0.75
MATH = ExpertMath(LIMIT)
ATTACH_TIMEOUT_S = 120.0
SPLITS = {  # owner [L, E] -> worker index
    "alternate": torch.tensor([[e % 2 for e in range(NUM_EXPERTS)]] * NUM_LAYERS),
    "per_layer": torch.tensor([[int((e * 3 + layer) % 4 == 0) for e in range(NUM_EXPERTS)]
                               for layer in range(NUM_LAYERS)]),
    "one_worker": torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.int64),
}
MODES = (CombineMode.PARTIAL, CombineMode.SLOTS)


def _owner_rows(owner: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in owner.tolist())


@pytest.fixture(scope="module")
def library():
    return load_mailbox()


@pytest.fixture(scope="module")
def layers():
    return random_layers(SEED, NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER)


@pytest.fixture(scope="module")
def gates():
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(HIDDEN, NUM_EXPERTS, generator=generator) for _ in range(NUM_LAYERS)]


def _route(gates):
    def route(layer: int, hidden: torch.Tensor):
        weights, ids = torch.topk(torch.softmax(hidden @ gates[layer], dim=-1), TOP_K, dim=-1)
        return ids, weights
    return route


def _spec(mailboxes, worker_index: int, **options) -> WorkerSpec:
    return WorkerSpec(tuple(mailboxes), worker_index, SEED, HIDDEN, INTER, LIMIT, **options)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two worker processes; segments[(mode, split)] = [segment of worker 0, segment of worker 1]."""
    directory = tmp_path_factory.mktemp("mailboxes")
    segments = {(mode, split): [MailboxSegment.create(MailboxLayout(T_MAX, HIDDEN, TOP_K, False, mode), index,
                                                      directory) for index in range(2)]
                for mode in MODES for split in SPLITS}
    processes = [spawn_worker(_spec([(str(pair[index].path), _owner_rows(SPLITS[split]))
                                     for (mode, split), pair in segments.items()], index)) for index in range(2)]
    try:
        for pair in segments.values():
            for index, segment in enumerate(pair):
                wait_until_attached(segment, processes[index].pid, ATTACH_TIMEOUT_S)
        yield segments, processes
    finally:
        for pair in segments.values():
            for segment in pair:
                segment.set_word(Word.STOP, 1)
        for process in processes:
            try:
                process.communicate(timeout=30)
            except Exception:
                process.kill()
                process.communicate()
        for pair in segments.values():
            for segment in pair:
                segment.close()


def _in_process(library, layers, owner: torch.Tensor, worker_index: int, mode: CombineMode) -> InProcessShare:
    local = owned_local_table(owner, worker_index)
    return InProcessShare(library.fp4_kernel(), owned_stacks(layers, local), local, MATH, mode)


def _reference_step(library, layers, route, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Every expert in this process, slots added in slot order: routed [T, D] per layer."""
    everything = _in_process(library, layers, torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.int64), 0,
                             CombineMode.SLOTS)
    routed_layers = []
    for layer in range(NUM_LAYERS):
        ids, weights = route(layer, hidden)
        routed = sum_slots_in_order(everything(layer, hidden, ids, weights))
        routed_layers.append(routed)
        hidden = hidden + routed
    return routed_layers


def _inputs(step: int, num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(100 + step))


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
def test_steps_equal_in_process_experts(library, layers, gates, fleet, mode, split):
    segments, _ = fleet
    route = _route(gates)
    driver = MailboxDriver(library, segments[(mode, split)], SPLITS[split], timeout_s=10.0)
    for step, num_rows in enumerate((1, 5, T_MAX, 3)):
        x = _inputs(step, num_rows)
        result = driver.run_step(x, route)
        assert result.failures == []
        expected = _reference_step(library, layers, route, x)
        if mode is CombineMode.SLOTS or split == "one_worker":  # bitwise, whatever the split
            for layer in range(NUM_LAYERS):
                assert torch.equal(result.routed[layer], expected[layer]), (step, layer)
        else:  # bitwise the in-process partials added in worker order; the slot-order sum to rounding
            shares = [_in_process(library, layers, SPLITS[split], index, mode) for index in range(2)]
            hidden = x
            for layer in range(NUM_LAYERS):
                ids, weights = route(layer, hidden)
                partials = {index: share(layer, hidden, ids, weights) for index, share in enumerate(shares)}
                assert torch.equal(result.routed[layer], driver.combine(layer, ids, partials, num_rows, HIDDEN))
                torch.testing.assert_close(result.routed[layer], expected[layer], rtol=1e-5, atol=1e-6)
                hidden = hidden + result.routed[layer]
    assert all(segment.word(Word.WAIT_ERROR) == 0 for segment in segments[(mode, split)])


def test_in_process_reference_equals_torch_reference(library, layers, gates):
    """The in-process experts the mailbox is compared with equal the torch FP4 expert reference."""
    x = _inputs(0, 4)
    ids, weights = _route(gates)(0, x)
    got = _reference_step(library, layers, _route(gates), x)[0]
    expected = torch.zeros(4, HIDDEN)
    for token in range(4):
        for slot in range(TOP_K):
            tensors = [t[int(ids[token, slot])] for t in layers[0]]
            expected[token] += fp4_expert_reference(x[token][None], *tensors, LIMIT, weights[token, slot][None])[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


class _HeldLayer:
    """The attributes `cpu_experts.expert_rows` reads of a held layer."""

    def __init__(self, tensors, num_experts: int) -> None:
        self.w1, self.s1, self.w3, self.s3, self.w2, self.s2 = tensors
        self.local = torch.arange(num_experts)


def test_mailbox_equals_cpu_expert_worker_path(library, layers, gates, fleet):
    """The expert worker's CPU path (`cpu_experts.expert_rows` on the native kernel) on the same layer
    gives the mailbox's routed output bit for bit."""
    from moemesh.common.model.cpu_experts import CpuBlockRunner, expert_rows

    segments, _ = fleet
    driver = MailboxDriver(library, segments[(CombineMode.SLOTS, "alternate")], SPLITS["alternate"], timeout_s=10.0)
    route = _route(gates)
    x = _inputs(5, 6)
    result = driver.run_step(x, route)
    assert result.failures == []
    runner = CpuBlockRunner(1, use_native=True)
    hidden = x
    for layer in range(NUM_LAYERS):
        ids, weights = route(layer, hidden)
        rows = expert_rows(_HeldLayer(layers[layer], NUM_EXPERTS), hidden, ids, weights, None, LIMIT, False, runner)
        assert torch.equal(result.routed[layer], sum_slots_in_order(rows)), layer
        hidden = hidden + result.routed[layer]


def test_worker_that_never_answers_times_out_and_failover_is_exact(library, layers, gates, fleet, tmp_path):
    """Worker 1's segment has no worker: the step ends within the bound, the wait-error word names
    worker 1, and the step re-run with worker 1's share computed in process is exact."""
    segments, _ = fleet
    mode, split = CombineMode.SLOTS, "alternate"
    silent = MailboxSegment.create(segments[(mode, split)][1].layout, 1, tmp_path)
    route = _route(gates)
    timeout_s = 0.5
    driver = MailboxDriver(library, [segments[(mode, split)][0], silent], SPLITS[split], timeout_s=timeout_s)
    x = _inputs(7, 4)
    started = time.monotonic()
    result = driver.run_step(x, route)
    elapsed = time.monotonic() - started
    assert timeout_s <= elapsed < timeout_s + 2.0  # waited once, later layers did not wait again
    assert [(f.worker_index, f.layer, f.code) for f in result.failures] == [(1, 0, MailboxError.TIMEOUT)]
    word = read_wait_error(silent)
    assert word is not None and word.worker_index == 1 and word.code is MailboxError.TIMEOUT
    assert split_seq(word.seq) == (result.epoch, 0)
    assert "expert worker 1" in result.failures[0].describe()
    failover = {1: _in_process(library, layers, SPLITS[split], 1, mode)}
    driver.timeout_s = 10.0  # live workers only from here: a loaded host must not fail them
    recovered = driver.run_step(x, route, replacements=failover)
    assert recovered.failures == [] and recovered.epoch == result.epoch + 1
    for got, expected in zip(recovered.routed, _reference_step(library, layers, route, x)):
        assert torch.equal(got, expected)
    silent.close()


def test_frozen_worker_late_answers_are_not_taken_for_new_ones(library, layers, gates, fleet):
    """SIGSTOP worker 1 between steps: the next step times out (its done word still holds the last
    step's seq, which must not count); after SIGCONT it answers the abandoned seqs late, and the next
    step (a new epoch) is exact again."""
    segments, processes = fleet
    mode, split = CombineMode.PARTIAL, "one_worker"  # worker 0 owns all: results are bitwise
    route = _route(gates)
    driver = MailboxDriver(library, segments[(mode, split)], SPLITS[split], timeout_s=10.0)
    x = _inputs(9, 6)
    expected = _reference_step(library, layers, route, x)
    assert driver.run_step(x, route).failures == []
    driver.timeout_s = 0.5
    stale = segments[(mode, split)][1].word(Word.DONE_SEQ)
    os.kill(processes[1].pid, signal.SIGSTOP)
    try:
        result = driver.run_step(x, route)
        assert [(f.worker_index, f.code, f.detail) for f in result.failures] == [(1, MailboxError.TIMEOUT, stale)]
    finally:
        os.kill(processes[1].pid, signal.SIGCONT)
    driver.timeout_s = 10.0
    for _ in range(2):
        again = driver.run_step(x, route)
        assert again.failures == []
        assert all(torch.equal(got, want) for got, want in zip(again.routed, expected))


def test_worker_killed_mid_step_then_restarted(library, layers, gates, fleet, tmp_path):
    """SIGKILL a worker after it served layer 0 of a step: layer 1 times out naming it, failover gives
    the exact result; a worker restarted on the same segment serves only seqs posted after it attached."""
    segments, _ = fleet
    mode, split = CombineMode.SLOTS, "per_layer"
    layout = segments[(mode, split)][1].layout
    victim_segment = MailboxSegment.create(layout, 1, tmp_path)
    victim = spawn_worker(_spec([(str(victim_segment.path), _owner_rows(SPLITS[split]))], 1))
    wait_until_attached(victim_segment, victim.pid, ATTACH_TIMEOUT_S)
    route = _route(gates)
    driver = MailboxDriver(library, [segments[(mode, split)][0], victim_segment], SPLITS[split], timeout_s=10.0)
    x = _inputs(11, 5)
    expected = _reference_step(library, layers, route, x)
    assert driver.run_step(x, route).failures == []
    driver.timeout_s = 0.5

    def route_then_kill(layer: int, hidden: torch.Tensor):
        if layer == 1:
            victim.kill()
            victim.wait(timeout=30)
        return route(layer, hidden)

    result = driver.run_step(x, route_then_kill)
    assert [(f.worker_index, f.layer, f.code) for f in result.failures] == [(1, 1, MailboxError.TIMEOUT)]
    failover = {1: _in_process(library, layers, SPLITS[split], 1, mode)}
    driver.timeout_s = 10.0
    recovered = driver.run_step(x, route, replacements=failover)
    assert recovered.failures == [] and all(torch.equal(a, b) for a, b in zip(recovered.routed, expected))

    # a restarted worker (here a native thread of this process) attaches to the same segment
    abandoned = victim_segment.word(Word.DISPATCH_SEQ)
    local = owned_local_table(SPLITS[split], 1)
    restarted = MailboxWorker(library, victim_segment, owned_stacks(layers, local), local, MATH)
    try:
        assert victim_segment.word(Word.ATTACH_SEQ) == abandoned
        again = driver.run_step(x, route)
        assert again.failures == [] and all(torch.equal(a, b) for a, b in zip(again.routed, expected))
    finally:
        served, failed = restarted.stop()
    assert (served, failed) == (NUM_LAYERS, 0)  # the abandoned seq was not served
    victim_segment.close()


def test_worker_error_words(library, gates, fleet):
    """A layer beyond the worker's placement and an expert id out of range come back as the worker's
    error words (released with the done seq, so the step does not wait for the timeout)."""
    segments, _ = fleet
    pair = segments[(CombineMode.PARTIAL, "alternate")]
    too_many_layers = torch.cat([SPLITS["alternate"], SPLITS["alternate"][:1]])  # L + 1 layers
    driver = MailboxDriver(library, pair, too_many_layers, timeout_s=5.0)
    route = _route(gates + gates[:1])
    started = time.monotonic()
    result = driver.run_step(_inputs(3, 2), route)
    assert time.monotonic() - started < 5.0
    assert sorted((f.worker_index, f.layer, f.code, f.detail) for f in result.failures) == [
        (0, NUM_LAYERS, MailboxError.BAD_LAYER, NUM_LAYERS), (1, NUM_LAYERS, MailboxError.BAD_LAYER, NUM_LAYERS)]

    def bad_ids(layer: int, hidden: torch.Tensor):
        ids, weights = route(layer, hidden)
        ids[1, 2] = NUM_EXPERTS  # slot 1·K + 2
        return ids, weights

    driver = MailboxDriver(library, pair, SPLITS["alternate"], timeout_s=5.0)
    result = driver.run_step(_inputs(3, 2), bad_ids)
    assert {(f.worker_index, f.layer, f.code, f.detail) for f in result.failures} == {
        (0, 0, MailboxError.BAD_EXPERT, TOP_K + 2), (1, 0, MailboxError.BAD_EXPERT, TOP_K + 2)}
    assert driver.run_step(_inputs(3, 2), _route(gates)).failures == []  # the workers serve on


def test_bf16_hidden_rows(library, layers, gates, tmp_path):
    """bf16 activations in the slot (what the GPU writes): equal to the in-process kernel on the same
    bf16 rows; a native worker thread in this process."""
    layout = MailboxLayout(T_MAX, HIDDEN, TOP_K, True, CombineMode.SLOTS)
    owner = SPLITS["one_worker"]
    segment = MailboxSegment.create(layout, 0, tmp_path)
    local = owned_local_table(owner, 0)
    worker = MailboxWorker(library, segment, owned_stacks(layers, local), local, MATH, num_threads=2)
    try:
        driver = MailboxDriver(library, [segment], owner, timeout_s=10.0)
        route = _route(gates)
        x = _inputs(4, 7)
        result = driver.run_step(x, route)
        assert result.failures == []
        share = _in_process(library, layers, owner, 0, CombineMode.SLOTS)
        hidden = x
        for layer in range(NUM_LAYERS):
            ids, weights = route(layer, hidden)
            expected = sum_slots_in_order(share(layer, hidden.to(torch.bfloat16), ids, weights))
            assert torch.equal(result.routed[layer], expected)
            hidden = hidden + result.routed[layer]
    finally:
        worker.stop()
        segment.close()


def test_layout_and_header_checks(library, layers, tmp_path):
    layout = MailboxLayout(4, 64, 2, False, CombineMode.PARTIAL)
    segment = MailboxSegment.create(layout, 0, tmp_path)
    try:
        attached = MailboxSegment.attach(segment.path)
        assert attached.layout == layout and attached.worker_index == 0
        attached.close()
        local = owned_local_table(SPLITS["one_worker"], 0)
        stacks = owned_stacks(layers, local)
        segment.set_word(Word.REGION_COMBINE, segment.word(Word.REGION_COMBINE) + 8)
        with pytest.raises(ValueError, match="header word at 88"):
            MailboxWorker(library, segment, stacks, local, MATH)
        with pytest.raises(ValueError, match="REGION_COMBINE"):
            MailboxSegment.attach(segment.path)
        segment.set_word(Word.MAGIC, 0)
        with pytest.raises(ValueError, match="magic"):
            MailboxWorker(library, segment, stacks, local, MATH)
    finally:
        segment.close()
    assert not segment.path.exists()


def test_missing_compiler_is_a_build_error(monkeypatch):
    from moemesh.common.kernels.cpu_fp4_build import NativeBuildError

    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(NativeBuildError, match="no C compiler"):
        load_mailbox()


def test_sequence_numbers_grow_along_steps():
    seqs = [make_seq(epoch, layer) for epoch in (1, 2, 3) for layer in range(NUM_LAYERS)]
    assert seqs == sorted(set(seqs)) and seqs[0] > 0
    assert [split_seq(seq) for seq in seqs[:4]] == [(1, 0), (1, 1), (1, 2), (2, 0)]
    with pytest.raises(ValueError):
        make_seq(0, 1)


def test_wait_bounds(library, tmp_path):
    """The flag wait returns 'equal', 'passed' or 'timeout' (after the bound, not long after)."""
    segment = MailboxSegment.create(MailboxLayout(1, 32, 1), 0, tmp_path)
    try:
        address = segment.word_address(Word.DONE_SEQ)
        library.store_release(address, make_seq(2, 1))
        assert library.wait(address, make_seq(2, 1), 1.0, WaitConfig()) == (0, make_seq(2, 1))
        assert library.wait(address, make_seq(2, 0), 1.0, WaitConfig()) == (2, make_seq(2, 1))
        started = time.monotonic()
        assert library.wait(address, make_seq(2, 2), 0.05, WaitConfig(sleep_max_us=1000.0)) == (1, make_seq(2, 1))
        assert 0.05 <= time.monotonic() - started < 1.0
    finally:
        segment.close()


def test_bench_runs(tmp_path):
    """`python -m moemesh.bench.cpu_mailbox` end to end at a tiny size: one JSON with a record per T."""
    import json

    from moemesh.bench import cpu_mailbox

    assert cpu_mailbox.main(["--T", "1,3", "--modes", "echo", "--waits", "backoff", "--layers", "2", "--steps", "2",
                             "--warmup", "0", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("cpu-mailbox-cpu-*.json")
    records = json.loads(path.read_text())["raw"]["records"]
    assert [(r["mode"], r["T"], r["layers_served"]) for r in records] == [("echo", 1, 4), ("echo", 3, 4)]
    assert all(r["round_trip_us"] > 0 for r in records)
