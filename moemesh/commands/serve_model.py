"""What `moemesh serve --model X` serves: a local checkpoint directory, or a Hugging Face hub id.

    X is an existing directory            -> that directory
    X looks like a hub id (org/name)      -> huggingface_hub.snapshot_download(X, revision):
                                             the snapshot in the hub cache ($HF_HOME/hub, or
                                             $HF_HUB_CACHE), downloaded first unless HF_HUB_OFFLINE=1
    otherwise                             -> HubModelMissing naming X

Only the files serving reads are fetched (config, tokenizer, generation config, safetensors
and their index). With HF_HUB_OFFLINE=1 (or no network) the cache alone answers, and a
model or revision missing from it is an error naming the id, the revision and the cache
directory. `--revision` pins a branch, tag or commit, as in transformers and vLLM.
Imports huggingface_hub only when a hub id is given.
"""

from __future__ import annotations

import re
from pathlib import Path

# what serving a checkpoint reads (common/checkpoint, the router's tokenizer, generation defaults)
SERVE_FILE_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class HubModelMissing(Exception):
    """A hub id that cannot be resolved to a local snapshot; the message names the id and why."""


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and ".." not in text and not text.endswith((".", "-"))


def is_hub_id(model: str) -> bool:
    """Whether `--model` names a hub repository rather than a local directory."""
    return not Path(model).expanduser().is_dir() and looks_like_hub_id(model) and not model.startswith(("/", ".", "~"))


def resolve_model(model: str, revision: str | None = None) -> Path:
    """The checkpoint directory to serve for `--model` (see the module docstring)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise HubModelMissing(f"--revision {revision} applies to a hub id, but {model} is a local directory")
        return path
    if not is_hub_id(model):
        return path  # not a hub id: check_model_dir names the missing directory
    try:
        return Path(_snapshot(model, revision))
    except HubModelMissing as error:
        raise HubModelMissing(f"no checkpoint directory {model}; as a hub id: {error}") from None


def _snapshot(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r} (revision {revision or 'main'})"
    cache = constants.HF_HUB_CACHE
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=list(SERVE_FILE_PATTERNS),
                                 local_files_only=bool(constants.HF_HUB_OFFLINE))
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise HubModelMissing(
            f"model {where} is not in the local Hugging Face cache {cache} and {offline}; download it first "
            f"(`hf download {repo_id}`) or pass a checkpoint directory") from None
    except RevisionNotFoundError:
        raise HubModelMissing(f"model {where}: the hub has no such revision") from None
    except GatedRepoError:
        raise HubModelMissing(f"model {where} is gated: accept its terms and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubModelMissing(f"model {where}: no such repository on the hub (or it is private)") from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise HubModelMissing(f"model {where}: cannot fetch it: {error}") from None
