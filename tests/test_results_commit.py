"""Benchmark results name the commit they were measured at, and say so when the tracked files had changed."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from moemesh.bench.results_io import current_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(directory, *args):
    subprocess.run(["git", *args], cwd=directory, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(directory), "PATH": "/usr/bin:/bin"})


def test_a_changed_tracked_file_marks_the_commit(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "first")
    clean = current_commit(tmp_path)
    assert clean and "+" not in clean
    (tmp_path / "untracked.txt").write_text("not counted")
    assert current_commit(tmp_path) == clean
    (tmp_path / "a.txt").write_text("two")
    assert current_commit(tmp_path) == f"{clean}+changes"


def test_outside_a_checkout_there_is_no_commit(tmp_path):
    assert current_commit(tmp_path) is None
