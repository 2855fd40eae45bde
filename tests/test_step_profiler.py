"""The attention worker's torch.profiler window (services/attention/step_profiler.py): only the steps of
SKIP:COUNT are profiled, the trace and the tables land in MOEMESH_TORCH_PROFILE_DIR, a bad window is refused."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from moemesh.services.attention.step_profiler import StepProfiler, parse_window


def test_the_window_is_profiled_and_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEMESH_TORCH_PROFILE_STEPS", "1:2")
    monkeypatch.setenv("MOEMESH_TORCH_PROFILE_DIR", str(tmp_path))
    profiler = StepProfiler.from_env("attention-0", torch.device("cpu"))
    x = torch.randn(64, 64)
    for kind in ("prefill", "decode", "verify", "decode"):
        assert profiler.profiler is None or kind != "prefill"
        with profiler.step(kind):
            x = (x @ x).tanh()
        assert (profiler.profiler is not None) == (profiler.num_steps == 2)  # open after step 1, closed after 2
    [trace] = tmp_path.glob("attention-attention-0-*.torch.json.gz")
    names = {event.get("name") for event in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert {"moemesh.step.decode", "moemesh.step.verify"} <= names
    assert "moemesh.step.prefill" not in names  # step 0 was skipped
    [table] = tmp_path.glob("attention-attention-0-*.torch.txt")
    assert "aten::mm" in table.read_text()


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("MOEMESH_TORCH_PROFILE_STEPS", raising=False)
    assert StepProfiler.from_env("a", torch.device("cpu")) is None


@pytest.mark.parametrize("value", ["5", "a:b", "-1:3", "2:0"])
def test_a_bad_window_is_refused(value):
    with pytest.raises(ValueError, match="MOEMESH_TORCH_PROFILE_STEPS"):
        parse_window(value)
