"""Whether a directory holds a model that can be served: config.json, tokenizer.json and
safetensors weights. Torch-free."""

from __future__ import annotations

from pathlib import Path


class ModelMissing(Exception):
    """The model directory cannot be served (no config.json or no weights)."""


def check_model_dir(path: str | Path) -> Path:
    """The model directory, or ModelMissing naming what is absent (the embedded model may not
    be trained yet: its directory then holds only the tokenizer)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelMissing(f"model directory {path} does not exist")
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelMissing(f"model directory {path} has no {', '.join(missing)}; train it or pass --model")
    return path
