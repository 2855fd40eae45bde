"""`moemesh keys generate|show` through the real CLI dispatcher and as a real process."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import zmq.auth

from moemesh.cli import main
from moemesh.common.security.curve import load_key_pair, load_public_keys

REPO = Path(__file__).resolve().parents[1]


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_generate_writes_pairs_with_right_permissions(tmp_path, capsys):
    out = tmp_path / "keys"
    assert main(["keys", "generate", "--out", str(out), "--name", "router", "--name", "expert-cuda0"]) == 0
    for name in ("router", "expert-cuda0"):
        assert _mode(out / f"{name}.key_secret") == 0o600
        assert _mode(out / f"{name}.key") == 0o644
        pair = load_key_pair(out, name)
        assert zmq.auth.load_certificate(str(out / f"{name}.key")) == (pair.public_key, None)
    assert _mode(out) == 0o700
    printed = capsys.readouterr().out
    assert load_key_pair(out, "router").public_key.decode() in printed
    assert load_key_pair(out, "router").secret_key.decode() not in printed  # secrets are never printed


def test_generate_refuses_to_replace_without_force(tmp_path, capsys):
    out = tmp_path / "keys"
    assert main(["keys", "generate", "--out", str(out), "--name", "router"]) == 0
    before = load_key_pair(out, "router")
    assert main(["keys", "generate", "--out", str(out), "--name", "draft", "--name", "router"]) == 1
    assert "--force" in capsys.readouterr().err
    assert not (out / "draft.key").exists()  # nothing half-written
    assert load_key_pair(out, "router") == before
    assert main(["keys", "generate", "--out", str(out), "--name", "router", "--force"]) == 0
    assert load_key_pair(out, "router") != before


def test_generate_rejects_bad_names_and_empty_requests(tmp_path, capsys):
    assert main(["keys", "generate", "--out", str(tmp_path), "--name", "../escape"]) == 1
    assert main(["keys", "generate", "--out", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []


def test_show_and_the_installed_entry_point(tmp_path):
    out = tmp_path / "keys"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "moemesh.cli", "keys"]
    done = subprocess.run([*command, "generate", "--out", str(out), "--name", "attention-0"],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    shown = subprocess.run([*command, "show", str(out)], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == ["attention-0", load_public_keys(out)["attention-0"].decode()]


def test_keys_command_imports_no_torch():
    probe = ("import sys, moemesh.commands.keys, moemesh.common.runtime.deployment_security; "
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    assert done.stdout.strip() == "False"
