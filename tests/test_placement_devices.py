"""Device arguments: sizes, rates, hops; mistakes are refused with the offending text."""

from __future__ import annotations

import pytest

from moemesh.common.placement.devices import DeviceSpecError, build_devices, parse_rate, parse_size


def test_sizes_need_explicit_units():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("13.37MB") == 13_370_000
    assert parse_size("1e3 B") == 1000
    for bad in ("80G", "80", "GiB", "-1GiB"):
        with pytest.raises(DeviceSpecError, match="needs a number and a unit"):
            parse_size(bad)


def test_rates():
    assert parse_rate("4000GB/s") == ("bytes_per_s", 4e12)
    assert parse_rate("1GiB/s") == ("bytes_per_s", 2**30)
    assert parse_rate("2e6tok/s") == ("expert_tokens_per_s", 2e6)
    with pytest.raises(DeviceSpecError, match="needs a unit"):
        parse_rate("4000")


def test_build_devices_combines_budget_rates_and_hops():
    cuda, cpu = build_devices(["cuda:0=80GiB", "cpu=100GB"], ["cuda:0=4000GB/s", "cuda:0=3e6tok/s"], ["cpu=600"])
    assert (cuda.name, cuda.budget_bytes, cuda.bytes_per_s, cuda.expert_tokens_per_s) == ("cuda:0", 80 * 2**30, 4e12, 3e6)
    assert not cuda.throughput_assumed and cuda.hop_s == 0.0
    assert cpu.throughput_assumed and cpu.bytes_per_s == 5e10 and cpu.hop_s == pytest.approx(6e-4)


@pytest.mark.parametrize(
    ("budgets", "throughputs", "hops", "message"),
    [
        ([], [], [], "at least one --budget"),
        (["cuda:0=1GiB", "cuda:0=2GiB"], [], [], "given twice for cuda:0"),
        (["cuda:0=1GiB"], ["cuda:1=1GB/s"], [], "cuda:1 has no --budget"),
        (["cuda:0=1GiB"], ["cuda:0=1GB/s", "cuda:0=2GB/s"], [], "bytes_per_s twice"),
        (["cuda:0=1GiB"], [], ["cuda:0=fast"], "'fast' is not a number"),
        (["GPU0=1GiB"], [], [], "not like 'cuda:0'"),
        (["cuda:0"], [], [], "not DEVICE=VALUE"),
    ],
)
def test_bad_device_arguments(budgets, throughputs, hops, message):
    with pytest.raises(DeviceSpecError, match=message):
        build_devices(budgets, throughputs, hops)
