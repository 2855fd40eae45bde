"""Errors of the checkpoint layer."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint does not match its config: missing, unexpected, mis-shaped or mis-typed
    tensors, unreadable files. The message names the tensor, what was expected and what was found."""
