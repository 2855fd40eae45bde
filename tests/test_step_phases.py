"""The attention worker's step-phase timing (services/attention/step_phases.py): marks add up per kind of
step, and the kind comes from the plan."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from moemesh.services.attention.step_phases import PHASES, StepPhases, step_kind


def _plan(*sequences):
    return SimpleNamespace(sequences=[SimpleNamespace(token_ids=t, draft_token_ids=d) for t, d in sequences])


def test_kinds_of_steps():
    assert step_kind(_plan(((5,), ()), ((6,), ()))) == "decode"
    assert step_kind(_plan(((5, 7, 8), (7, 8)), ((6,), ()))) == "verify"
    assert step_kind(_plan(((5, 6, 7), ()))) == "prefill"
    assert step_kind(_plan()) == "prefill"


def test_phases_add_up_per_kind():
    phases = StepPhases(torch.device("cpu"))
    for kind, pause_s in (("decode", 0.0), ("verify", 0.002), ("verify", 0.002)):
        timer = phases.start()
        for phase in PHASES[:-1]:
            if phase == "sample":
                time.sleep(pause_s)
            timer.mark(phase)
        timer.finish(kind)
    fields = phases.as_log_fields()
    assert fields["decode_num_steps"] == 1 and fields["verify_num_steps"] == 2
    assert fields["verify_sample_ms_mean"] >= 2.0 > fields["decode_sample_ms_mean"]
    total = sum(fields[f"verify_{phase}_ms_mean"] for phase in PHASES)
    assert abs(fields["verify_total_ms_mean"] - total) < 1e-3
    assert "verify_forward_device_ms_mean" not in fields  # device time only on CUDA
    assert "verify_forward_device_ms_median" not in fields


def test_medians_leave_out_a_slow_first_step():
    phases = StepPhases(torch.device("cpu"))
    for pause_s in (0.05, 0.001, 0.001, 0.001):  # a capture-like first step, then three quick ones
        timer = phases.start()
        time.sleep(pause_s)
        timer.mark("forward")
        timer.finish("decode")
    fields = phases.as_log_fields()
    assert fields["decode_forward_ms_mean"] > 10.0
    assert 1.0 <= fields["decode_forward_ms_median"] < 10.0
    assert fields["decode_total_ms_median"] >= fields["decode_forward_ms_median"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_forward_device_time_comes_from_cuda_events():
    phases = StepPhases(torch.device("cuda"))
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        timer = phases.start()
        timer.mark("prepare")
        timer.forward_started()
        for _ in range(20):
            x = (x @ x).tanh()
        timer.forward_done()
        timer.mark("forward")
        float(x.sum())  # the step's read-back
        timer.mark("sample")
        timer.finish("decode")
    fields = phases.as_log_fields()
    assert fields["decode_num_steps"] == 3 and fields["decode_forward_device_ms_mean"] > 0
    assert fields["decode_forward_device_ms_median"] > 0
