"""A Hugging Face hub cache filled offline, the way huggingface_hub lays it out (not a test module):

    <HF_HOME>/hub/models--<org>--<name>/blobs/<sha256>              the files' contents
    <HF_HOME>/hub/models--<org>--<name>/snapshots/<commit>/<file>   -> ../../blobs/<sha256>
    <HF_HOME>/hub/models--<org>--<name>/refs/<branch>               the commit hash
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "3f1d0c2b9a8e7d6c5b4a39281706f5e4d3c2b1a0"


def fill_hub_cache(hf_home: Path, repo_id: str, source_dir: Path, commit: str = COMMIT,
                   branch: str = "main") -> Path:
    """Put every file of `source_dir` into the cache as `repo_id` at `commit` (named by `branch`);
    the blobs link to the source files, so nothing large is copied. Returns the snapshot dir."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    blobs = repo / "blobs"
    snapshot.mkdir(parents=True, exist_ok=True)
    blobs.mkdir(parents=True, exist_ok=True)
    for path in sorted(source_dir.iterdir()):
        if not path.is_file():
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        blob = blobs / digest
        if not blob.exists():
            blob.symlink_to(path.resolve())
        link = snapshot / path.name
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot
