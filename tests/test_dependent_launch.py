"""When the decode kernels launch as programmatic dependents (common/kernels/dependent_launch.py): only when
switched on, never on the CPU or under the interpreter; the weight prefetch has its own value. The launch
itself is checked where it can run: tests/test_dependent_launch_cuda.py and test_kernels_compile_sm90.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moemesh.common.kernels.dependent_launch import (  # noqa: E402
    ENV_SWITCH, dependent_launch, dependent_launch_enabled, weight_prefetch_enabled,
)


def test_cpu_tensors_launch_plainly(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert dependent_launch(torch.device("cpu")) == {}
    assert not weight_prefetch_enabled(torch.device("cpu"))


def test_interpreter_and_switch_turn_it_off(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dependent_launch_enabled(cuda)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not dependent_launch_enabled(cuda) and dependent_launch(cuda) == {}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an sm_90 GPU")
def test_on_hopper_when_switched_on_and_prefetch_has_its_own_value(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    assert dependent_launch(cuda) == {}
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert dependent_launch(cuda) == {"launch_pdl": True, "USE_PDL": True}
    assert weight_prefetch_enabled(cuda)
    monkeypatch.setenv(ENV_SWITCH, "no-prefetch")
    assert dependent_launch_enabled(cuda) and not weight_prefetch_enabled(cuda)


def test_modes_of_the_switch(monkeypatch):
    from moemesh.common.kernels import dependent_launch as module

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(module, "_device_supports", lambda index: True)  # an sm_90 device, without one
    cuda = torch.device("cuda", 0)
    expected = {"1": (module.SIGNAL_AFTER_WAIT, True), "no-prefetch": (module.SIGNAL_AFTER_WAIT, False),
                "wait-only": (module.WAIT_ONLY, False)}
    for value, (mode, prefetch) in expected.items():
        monkeypatch.setenv(ENV_SWITCH, value)
        assert dependent_launch(cuda) == {"launch_pdl": True, "USE_PDL": mode}, value
        assert weight_prefetch_enabled(cuda) == prefetch, value
    for value in ("0", "yes", ""):
        monkeypatch.setenv(ENV_SWITCH, value)
        assert dependent_launch(cuda) == {} and not weight_prefetch_enabled(cuda), value


def test_rows_are_prefetched_only_from_16_byte_aligned_starts(monkeypatch):
    from moemesh.common.kernels import dependent_launch as module

    monkeypatch.setattr(module, "weight_prefetch_enabled", lambda device: True)
    weight = torch.zeros(8, 64, dtype=torch.uint8)  # rows of 64 bytes
    assert module.weight_rows_prefetchable(torch.device("cpu"), (weight, None), 64, 32)
    assert not module.weight_rows_prefetchable(torch.device("cpu"), (weight,), 64, 40)  # a split start off 16
    assert not module.weight_rows_prefetchable(torch.device("cpu"), (weight[:, 4:],), 64)  # a base off 16
    assert not module.weight_rows_prefetchable(torch.device("cpu"), (torch.zeros(8, 24, dtype=torch.uint8),), 16)
