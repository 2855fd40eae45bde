"""Unit pieces of the operations work: step recovery on real slots and states, load-progress
files, the status snapshot, and the benchmark plots."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from tiny_checkpoint_support import tiny_config
from moemesh.common.model.state import SequenceState
from moemesh.common.runtime.load_progress import LoadProgress, read_progress
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.messages import ScheduledSequence, SequenceResult, StepPlan, StepResult
from moemesh.services.attention.recovery import RecoveryConfig, StepRecovery, rollback_state
from moemesh.bench.plots import MAX_BARS_PER_PANEL, numeric_leaves, panels


def _advance_stores(state: SequenceState, layers: int, num_tokens: int) -> None:
    """Advance the stores of the first `layers` layers as a forward that died mid-way would."""
    for layer in state.layers[:layers]:
        layer.window.append(torch.zeros(num_tokens, layer.window._rows.shape[1]))
        for store in (layer.compressor, layer.indexer):
            if store is not None:
                width = store._kv.shape[1]
                store.append_inputs(torch.zeros(num_tokens, width), torch.zeros(num_tokens, width))


def test_rollback_state_undoes_a_half_done_forward():
    config = tiny_config()
    state = SequenceState(config)
    _advance_stores(state, len(state.layers), 5)
    state.advance(5)
    _advance_stores(state, 2, 1)  # a decode step that died after two layers
    rollback_state(state, 5)
    assert state.num_tokens == 5
    assert all(store.num_tokens == 5 for layer in state.layers for store in layer.stores())
    _advance_stores(state, len(state.layers), 1)  # the retry then runs every layer
    state.advance(1)
    assert state.num_tokens == 6


class _FakeSlots:
    """Stands in for the SlotTable (the plans here only start sequences at position 0)."""

    def __init__(self) -> None:
        self.slots: dict = {}

    def free(self, seq_slots):
        for seq_slot in seq_slots:
            self.slots.pop(seq_slot, None)


def _plan() -> StepPlan:
    return StepPlan(step_id=7, sequences=(ScheduledSequence(request_id="a", seq_slot=0, start_position=0,
                                                            token_ids=(5, 6), block_ids=(), do_sample=True),))


def test_recovery_retries_after_the_expert_answers_again():
    calls = []

    def compute(plan):
        calls.append(plan.step_id)
        if len(calls) == 1:
            raise ReplyTimeout("ipc://x", "dispatch", 0.1)
        return StepResult(plan.step_id, (SequenceResult("a", (9,)),))

    forgotten = []
    recovery = StepRecovery(RecoveryConfig(max_attempts=3, budget_s=5), _FakeSlots(), compute,
                            lambda: forgotten.append(True), lambda: True)
    result = recovery.run(_plan())
    assert result.sequences == (SequenceResult("a", (9,)),)
    assert calls == [7, 7] and forgotten == [True] and recovery.num_recovered_steps == 1


def test_recovery_logs_a_stalled_reply_with_the_steps_requests():
    from structlog.testing import capture_logs

    stalls = [[("ipc://expert-0", 2.5)], []]  # the first step's reply came late, the second's in time

    def compute(plan):
        return StepResult(plan.step_id, (SequenceResult("a", (9,)),))

    recovery = StepRecovery(RecoveryConfig(max_attempts=3, budget_s=5), _FakeSlots(), compute,
                            lambda: None, lambda: True, take_stalls=lambda: stalls.pop(0))
    with capture_logs() as events:
        recovery.run(_plan())
        recovery.run(_plan())
    stalled = [e for e in events if e["event"] == "attention.expert_reply_stalled"]
    assert len(stalled) == 1 and stalled[0]["log_level"] == "warning"
    assert stalled[0]["endpoint"] == "ipc://expert-0" and stalled[0]["request_ids"] == ["a"]


def test_recovery_gives_up_within_its_budget_with_a_clear_error():
    def compute(plan):
        raise ReplyTimeout("ipc://x", "dispatch", 0.1)

    import time

    freed = []  # the worker's own release (it also drops an in-process drafter's rings)
    recovery = StepRecovery(RecoveryConfig(max_attempts=5, budget_s=0.5, probe_interval_s=0.05),
                            _FakeSlots(), compute, lambda: None, lambda: False, free_slots=freed.append)
    started = time.monotonic()
    plan = dataclasses.replace(_plan(), free_seq_slots=(3,))
    result = recovery.run(plan)
    assert time.monotonic() - started < 2.0
    (only,) = result.sequences
    assert only.request_id == "a" and only.token_ids == () and "expert worker unavailable" in only.error
    assert recovery.num_failed_steps == 1 and freed == [(3,)]


def test_load_progress_is_logged_and_written(tmp_path):
    progress = LoadProgress("expert-0", "expert", tmp_path, min_interval_s=0.0)
    progress(1024, 3)
    (record,) = read_progress(tmp_path)
    assert record["num_bytes"] == 1024 and record["num_tensors"] == 3 and not record["done"]
    progress.finish()
    assert read_progress(tmp_path)[0]["done"] is True
    (tmp_path / "broken.json").write_text("{not json")
    assert [r["name"] for r in read_progress(tmp_path)] == ["expert-0"]


def test_numeric_leaves_of_a_bench_result():
    result = {"date": "2026", "device": "cpu", "ok": True, "decode": {"b1": {"step_ms": 2.5}, "sizes": [1, 8]}}
    assert list(numeric_leaves(result)) == [("decode.b1.step_ms", 2.5), ("decode.sizes[0]", 1.0),
                                            ("decode.sizes[1]", 8.0)]


def test_leaves_are_grouped_into_panels_of_one_kind():
    leaves = [("raw.ttft_ms.mean", 12.0), ("raw.output_tok_s", 5000.0), ("raw.num_completed", 200.0),
              ("ratios.step_over_floor", 7.1), ("raw.duration_s", 60.0), ("raw.decode.b1.step_us", 3.0),
              ("raw.fraction_exact", 0.25), ("raw.layer", 3.0)]
    assert {title: [path for path, _ in bars] for title, bars in panels(leaves).items()} == {
        "milliseconds": ["raw.ttft_ms.mean"], "per second (rates)": ["raw.output_tok_s"],
        "counts": ["raw.num_completed"], "ratios and fractions": ["ratios.step_over_floor", "raw.fraction_exact"],
        "seconds": ["raw.duration_s"], "microseconds": ["raw.decode.b1.step_us"], "other values": ["raw.layer"]}
    many = panels([(f"raw.case{index}_ms", float(index)) for index in range(MAX_BARS_PER_PANEL + 5)])
    assert len(many["milliseconds"]) == MAX_BARS_PER_PANEL


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plots_render_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from moemesh.bench.plots import render_all

    (tmp_path / "serve-1.json").write_text(json.dumps({"ttft_ms": {"mean": 12.0, "p99": 30.0}}))
    (written,) = render_all(tmp_path)
    assert written == tmp_path / "serve-1.png" and _png_size(written)[0] > 0
    assert render_all(tmp_path) == []  # a PNG newer than its JSON is not redrawn


def test_a_written_bench_result_gets_its_plot_beside_it(tmp_path):
    """What `moemesh bench NAME` leaves: the JSON and, with matplotlib, its PNG (one panel per kind,
    so a result with two kinds of figures draws a taller picture than one with a single kind)."""
    pytest.importorskip("matplotlib")
    from moemesh.bench.results_io import write_result

    one_kind = write_result("probe", {"step_ms": {"b1": 2.0, "b8": 3.5}}, out_dir=tmp_path / "a", command="probe")
    two_kinds = write_result("probe", {"step_ms": {"b1": 2.0, "b8": 3.5}, "tok_s": 4000.0},
                             {"b8_over_b1": 1.75}, out_dir=tmp_path / "b", command="probe")
    assert one_kind.with_suffix(".png").exists() and two_kinds.with_suffix(".png").exists()
    (_, short), (_, tall) = _png_size(one_kind.with_suffix(".png")), _png_size(two_kinds.with_suffix(".png"))
    assert tall > short


def test_serve_progress_bar_reads_the_progress_files(tmp_path):
    from moemesh.common.runtime.launcher import load_progress_bar
    from moemesh.common.runtime.load_progress import progress_dir_for

    LoadProgress("expert-0", "expert", progress_dir_for(tmp_path), min_interval_s=0.0)(3 * 2**20, 4)
    done = LoadProgress("attention-0", "attention", progress_dir_for(tmp_path))
    done.finish()
    line = load_progress_bar(tmp_path, ["attention-0", "expert-0", "expert-1"], width=4)
    assert line == "attention-0 [####] 0.0 MiB ready  expert-0 [....] 3.0 MiB  expert-1 [....] starting"
    line = load_progress_bar(tmp_path, ["expert-0"], width=4, expected_bytes={"expert-0": 6 * 2**20})
    assert line == "expert-0 [##..] 3.0 / 6.0 MiB"  # half of its share read: half a bar


def test_expected_load_bytes_split_the_checkpoint_by_service(tmp_path):
    """Attention side + every routed expert pair + drafter = the whole inventory; an expert worker's
    share follows its pairs, and progress records get a fraction clamped to [0, 1]."""
    from moemesh.common.model.inventory import tensor_inventory
    from moemesh.services.router.status_page_progress import load_sizes_for_config, with_expected

    config = tiny_config()
    sizes = load_sizes_for_config(config)
    total = sum(spec.num_bytes for spec in tensor_inventory(config).values())
    assert sizes.attention_bytes + sizes.draft_bytes + sum(sizes.expert_pair_bytes.values()) == total
    assert len(sizes.expert_pair_bytes) == config.num_hidden_layers * config.n_routed_experts
    placement = {"expert-0": {0: [0, 1]}, "expert-1": {layer: list(range(config.n_routed_experts))
                                                       for layer in range(config.num_hidden_layers)}}
    one_pair = sizes.expert_pair_bytes[(0, 0)]
    assert sizes.expected_for("expert", "expert-0", placement) == 2 * one_pair
    assert sizes.expected_for("expert", "expert-1", placement) == sum(sizes.expert_pair_bytes.values())
    assert sizes.expected_for("expert", "expert-9", placement) is None
    records = [{"name": "expert-0", "role": "expert", "num_bytes": one_pair, "done": False},
               {"name": "attention-0", "role": "attention", "num_bytes": 10 * sizes.attention_bytes, "done": False},
               {"name": "expert-9", "role": "expert", "num_bytes": 5, "done": False},
               {"name": "draft", "role": "draft", "num_bytes": 1, "done": True}]
    fractions = {r["name"]: r["fraction"] for r in with_expected(records, sizes, placement)}
    assert fractions == {"expert-0": 0.5, "attention-0": 1.0, "expert-9": None, "draft": 1.0}
