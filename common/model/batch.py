"""One forward's token layout: several sequences, each with some new tokens, flattened to [T].

Tokens of sequence i occupy the contiguous slice `slices[i]` of the flat token axis, in order; their
positions continue the sequence (state.num_tokens + 0..n-1). No padding anywhere. Linears run over
all T tokens at once; attention loops over the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.rope import RotaryTable
from common.model.state import SequenceState


@dataclass(frozen=True)
class SequenceChunk:
    """`num_new_tokens` new tokens of one sequence in this forward (prefill chunk, decode, or drafts)."""

    state: SequenceState
    num_new_tokens: int


class ForwardBatch:
    def __init__(self, chunks: list[SequenceChunk] | tuple[SequenceChunk, ...], device: torch.device | str) -> None:
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

    def cos_sin(self, table: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, R/2] of every token for one RoPE kind, computed once per forward."""
        if table.name not in self._rope_cache:
            self._rope_cache[table.name] = table.cos_sin(self.positions)
        return self._rope_cache[table.name]

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
