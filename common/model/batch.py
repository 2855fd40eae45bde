"""One forward's token layout: several sequences, each with some new tokens, flattened to [T].

Tokens of sequence i occupy the contiguous slice `slices[i]` of the flat token axis, in order; their
positions continue the sequence (state.num_tokens + 0..n-1). No padding anywhere. Linears run over
all T tokens at once. Attention either runs batched Triton kernels over every sequence at once
(`AttentionBackend.TRITON`: the batch then carries the device address tables of
`common.kernels.attention_layout`, built here, before any CUDA-graph capture of the layers) or
loops over the sequences in torch (`AttentionBackend.TORCH`, the reference and CPU path).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch

from moemesh.common.model.rope import RotaryTable
from moemesh.common.model.state import SequenceState


@dataclass(frozen=True)
class SequenceChunk:
    """`num_new_tokens` new tokens of one sequence in this forward (prefill chunk, decode, or drafts)."""

    state: SequenceState
    num_new_tokens: int


class AttentionBackend(enum.Enum):
    TORCH = "torch"
    TRITON = "triton"


def default_attention_backend(device: torch.device | str) -> AttentionBackend:
    """Triton kernels on CUDA, torch elsewhere; env MOEMESH_TORCH_ATTENTION=1 forces torch on CUDA."""
    if torch.device(device).type != "cuda" or os.environ.get("MOEMESH_TORCH_ATTENTION") == "1":
        return AttentionBackend.TORCH
    try:
        import triton  # noqa: F401
    except ImportError:
        return AttentionBackend.TORCH
    return AttentionBackend.TRITON


class ForwardBatch:
    def __init__(self, chunks: list[SequenceChunk] | tuple[SequenceChunk, ...], device: torch.device | str,
                 attention_backend: AttentionBackend | None = None) -> None:
        """attention_backend: None = `default_attention_backend(device)`. With TRITON the tables are
        built now; when a store cannot be addressed in place they are None and attention uses torch."""
        if not chunks:
            raise ValueError("a forward needs at least one sequence")
        if len({id(chunk.state) for chunk in chunks}) != len(chunks):
            raise ValueError("a sequence may appear only once per forward")
        self.chunks = tuple(chunks)
        self.slices: list[slice] = []
        self.start_positions: list[int] = []
        positions = []
        offset = 0
        for chunk in self.chunks:
            if chunk.num_new_tokens < 1:
                raise ValueError(f"num_new_tokens={chunk.num_new_tokens} must be >= 1")
            start = chunk.state.num_tokens
            self.slices.append(slice(offset, offset + chunk.num_new_tokens))
            self.start_positions.append(start)
            positions.append(torch.arange(start, start + chunk.num_new_tokens))
            offset += chunk.num_new_tokens
        self.num_tokens = offset
        self.positions = torch.cat(positions).to(device)  # [T] int64
        self._rope_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._finished = False
        if attention_backend is None:
            attention_backend = default_attention_backend(device)
        self.attention_tables = None  # common.kernels.attention_layout.AttentionTables when batched
        if attention_backend is AttentionBackend.TRITON:
            from moemesh.common.model.attention_tables import build_tables

            states = [chunk.state for chunk in self.chunks]
            self.attention_tables = build_tables(states[0].config, states, self.start_positions,
                                                 [chunk.num_new_tokens for chunk in self.chunks], self.positions)

    def cos_sin(self, table: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, R/2] of every token for one RoPE kind, computed once per forward (or given by
        `set_rope`)."""
        if table.name not in self._rope_cache:
            self._rope_cache[table.name] = table.cos_sin(self.positions)
        return self._rope_cache[table.name]

    def set_rope(self, cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every RoPE kind's (cos, sin) of this forward's positions, computed together at its start."""
        self._rope_cache.update(cos_sin)

    def last_token_indices(self) -> torch.Tensor:
        """Flat index of each sequence's last new token -> [B]."""
        return torch.tensor([s.stop - 1 for s in self.slices], device=self.positions.device)

    def finish(self) -> None:
        """Advance every sequence's counter; call once after all layers ran."""
        if self._finished:
            raise RuntimeError("ForwardBatch.finish called twice")
        for chunk in self.chunks:
            chunk.state.advance(chunk.num_new_tokens)
        self._finished = True
