"""The installed distribution claims one import name, `moemesh`, and nothing else.

Builds the wheel from this checkout (no network: the test environment's setuptools builds it),
installs it without dependencies into a fresh virtual environment and compares site-packages
before and after.
"""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _site_packages(env_dir: Path) -> Path:
    found = sorted(env_dir.glob("lib/python*/site-packages"))
    assert found, f"no site-packages under {env_dir}"
    return found[0]


def _import_names(site_packages: Path) -> set[str]:
    names = set()
    for entry in site_packages.iterdir():
        if entry.name.endswith((".dist-info", ".pth")) or entry.name.startswith(("_", ".")):
            continue
        names.add(entry.name.removesuffix(".py"))
    return names


@pytest.mark.slow
def test_wheel_installs_only_the_moemesh_import_name(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(REPO_ROOT)],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel_path, = (tmp_path / "dist").glob("moemesh-*.whl")
    with zipfile.ZipFile(wheel_path) as wheel:
        members = wheel.namelist()
        top_level_file, = [name for name in members if name.endswith(".dist-info/top_level.txt")]
        assert wheel.read(top_level_file).decode().split() == ["moemesh"]
    assert {name.split("/")[0] for name in members} == {"moemesh", wheel_path.name.split("-")[0] + "-"
                                                        + wheel_path.name.split("-")[1] + ".dist-info"}
    for expected in ("moemesh/cli.py", "moemesh/common/kernels/cpu_fp4.c", "moemesh/services/router/main.py",
                     "moemesh/services/router/status_page.html", "moemesh/bench/serve.py"):
        assert expected in members, expected

    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    env_python = env_dir / "bin" / "python"
    before = _import_names(_site_packages(env_dir))
    installed = subprocess.run([str(env_python), "-m", "pip", "install", "--no-deps", "-q", str(wheel_path)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert _import_names(_site_packages(env_dir)) - before == {"moemesh"}
    # installed (not from the source tree), the mapped folders import under moemesh; their package
    # files import nothing beyond the standard library, so --no-deps is enough here
    probe = subprocess.run([str(env_python), "-c", "import moemesh.common.checkpoint, moemesh.services.router, "
                            "moemesh.bench, moemesh.tools; import sys; "
                            "print(*(sys.modules[n].__file__ for n in sys.modules if n.startswith('moemesh')))"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-2000:]
    files = probe.stdout.split()
    assert len(files) >= 5 and all(f.startswith(str(_site_packages(env_dir))) for f in files), files
