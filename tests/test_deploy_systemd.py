"""The systemd units in deploy/systemd: `systemd-analyze verify` on each (instances for the
templates), and the properties the deployment relies on."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS_DIR = Path(__file__).resolve().parents[1] / "deploy" / "systemd"
INSTALLED_MOEMESH = "/opt/moemesh/.venv/bin/moemesh"
MPS_CONTROL = "/usr/bin/nvidia-cuda-mps-control"
SERVICE_UNITS = {  # unit file -> (sub-command, how the worker is chosen)
    "moemesh-router.service": ("router", None),
    "moemesh-attention@.service": ("attention", "--name attention-%i"),
    "moemesh-expert@.service": ("expert", "--name expert-%i"),
    "moemesh-draft.service": ("draft", None),
}
INSTANCES = {"moemesh-attention@.service": "moemesh-attention@0.service",
             "moemesh-expert@.service": "moemesh-expert@cuda0.service"}


def _unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False)  # systemd allows repeated keys (Environment=)
    parser.optionxform = str
    parser.read(UNITS_DIR / name)
    return parser


def _all_lines(name: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in (UNITS_DIR / name).read_text().splitlines() if line.startswith(key + "=")]


def test_every_service_has_a_unit_run_with_the_config_path():
    assert {path.name for path in UNITS_DIR.iterdir()} == {*SERVICE_UNITS, "moemesh.target", "moemesh-mps.service"}
    for name, (command, selector) in SERVICE_UNITS.items():
        unit = _unit(name)
        expected = f"{INSTALLED_MOEMESH} {command} --config /etc/moemesh/moemesh.toml"
        assert unit["Service"]["ExecStart"] == expected + (f" {selector}" if selector else ""), name
        assert unit["Service"]["Restart"] == "on-failure", name
        assert unit["Unit"]["PartOf"] == "moemesh.target", name
        assert unit["Install"]["WantedBy"] == "moemesh.target", name
        assert unit["Service"]["SyslogIdentifier"].startswith("moemesh-" + command), name  # logs per unit
        assert unit["Service"]["StandardOutput"] == "journal", name
        assert unit["Service"]["LogsDirectory"] == "moemesh", name
        assert int(unit["Service"]["TimeoutStopSec"]) > 30, name  # longer than the default drain bound
    assert _unit("moemesh.target")["Install"]["WantedBy"] == "multi-user.target"


def test_gpu_workers_share_the_mps_daemon_settings():
    mps_env = set(_all_lines("moemesh-mps.service", "Environment"))
    assert any(line.startswith("CUDA_MPS_PIPE_DIRECTORY=") for line in mps_env)
    for name in ("moemesh-attention@.service", "moemesh-expert@.service", "moemesh-draft.service"):
        assert mps_env <= set(_all_lines(name, "Environment")), name
        assert "moemesh-mps.service" in _unit(name)["Unit"]["After"], name
    assert _unit("moemesh-mps.service")["Unit"]["ConditionPathExists"] == MPS_CONTROL


def _verifiable_copy(tmp_path: Path) -> Path:
    """The units with the install paths pointed at executables that exist here (verify checks
    that ExecStart binaries exist); nothing else changes."""
    copy_dir = tmp_path / "units"
    copy_dir.mkdir()
    for path in UNITS_DIR.iterdir():
        text = path.read_text().replace(INSTALLED_MOEMESH, sys.executable).replace(MPS_CONTROL, shutil.which("true"))
        (copy_dir / path.name).write_text(text)
    return copy_dir


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit_name", sorted(p.name for p in UNITS_DIR.iterdir()))
def test_systemd_analyze_verify(unit_name, tmp_path):
    copy_dir = _verifiable_copy(tmp_path)
    target = str(copy_dir / unit_name)
    if unit_name in INSTANCES:  # verify a concrete instance of the template
        target = f"{target}:{INSTANCES[unit_name]}"
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", target],
                          capture_output=True, text=True, timeout=60, check=False)
    # verify reports unknown keys and bad values as warnings with exit status 0: any line about
    # our units counts as a failure.
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "moemesh" in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_verify_would_catch_a_broken_unit(tmp_path):
    copy_dir = _verifiable_copy(tmp_path)
    broken = copy_dir / "moemesh-router.service"
    broken.write_text(broken.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(broken)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert any("moemesh" in line for line in (done.stdout + done.stderr).splitlines())
