"""The training split as units, packed into windows afresh every epoch.

The dataset stores its units (a chunk of running text, or one chat conversation; each starts with
BOS) concatenated and cut into [N, S] windows once. Trained on that fixed packing, every unit
always follows the same neighbours, and a model that memorises the stream can predict a chat
answer from the unit before it instead of from the question: it then recites in training and not
when a user asks the same question at position 0. `UnitWindows` recovers the units from the BOS
positions and packs them again at the start of every epoch, in a seeded random order, whole
units only (a window is closed, padded, when the next unit does not fit; a unit longer than a window
is cut into window-sized pieces once), so the question is the only thing that predicts an answer
and no answer is cut off from its question by a window boundary.

The packed order is built on the host with numpy (one pass over ~10^5 units, tens of ms an epoch);
the tokens stay on the device, and a step gathers its windows through an index tensor (one
host-to-device copy of the index per epoch, none per step).
Legend: N tokens in the split, U units, W windows in an epoch, S tokens per window, B windows per batch.
"""

from __future__ import annotations

import numpy as np
import torch

from moemesh.tools.corpus.special_tokens import BOS_ID, PAD_ID


def unit_spans(flat_ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """flat_ids [N] (trailing padding removed) -> (starts [U], lengths [U]) of the units, each cut into
    pieces of at most seq_len tokens. ValueError when the stream does not start with BOS."""
    if flat_ids.size == 0:
        raise ValueError("the training split holds no tokens")
    if int(flat_ids[0]) != BOS_ID:
        raise ValueError(f"the training split must start with BOS (id {BOS_ID}), found id {int(flat_ids[0])}")
    starts = np.flatnonzero(flat_ids == BOS_ID)
    lengths = np.diff(np.append(starts, flat_ids.size))
    pieces = -(-lengths // seq_len)  # [U] pieces per unit
    first = np.repeat(starts, pieces)
    offset = (np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * seq_len
    piece_starts = first + offset
    piece_lengths = np.minimum(seq_len, np.repeat(starts + lengths, pieces) - piece_starts)
    return piece_starts.astype(np.int64), piece_lengths.astype(np.int64)


def pack_order(lengths: np.ndarray, order: np.ndarray, seq_len: int) -> np.ndarray:
    """dest [U] (indexed by unit, not by order): the offset (window * seq_len + position) of each unit
    when the units are placed in `order`, whole, filling a window until the next one does not fit."""
    dest = np.empty(lengths.size, dtype=np.int64)
    window, fill = 0, 0
    for unit in order.tolist():
        length = int(lengths[unit])
        if fill + length > seq_len:
            window, fill = window + 1, 0
        dest[unit] = window * seq_len + fill
        fill += length
    return dest


class UnitWindows:
    """Batches of [B, S] windows of whole units, packed in a new seeded order every epoch."""

    def __init__(self, data, seq_len: int, batch_size: int, seed: int, device) -> None:
        ids, mask = data  # [N0, S0] uint16, [N0, S0] uint8 as stored (S0 need not be seq_len)
        self.seq_len = seq_len
        flat_ids = np.ascontiguousarray(ids).reshape(-1)
        flat_mask = np.ascontiguousarray(mask).reshape(-1)
        num_tokens = flat_ids.size
        while num_tokens and int(flat_ids[num_tokens - 1]) == PAD_ID:  # the stored packing's tail
            num_tokens -= 1
        self.starts, self.lengths = unit_spans(flat_ids[:num_tokens], self.seq_len)
        self.num_tokens = num_tokens
        self.device = torch.device(device)
        self.batch_size = batch_size
        # [N + 1]: the last entry is the padding a window's unused tail gathers (PAD, no loss)
        self.ids = torch.from_numpy(np.append(flat_ids[:num_tokens], PAD_ID).astype(np.int32)).to(self.device)
        self.mask = torch.from_numpy(np.append(flat_mask[:num_tokens], 0).astype(np.uint8)).to(self.device)
        self.rng = np.random.default_rng(seed)
        self.pending = torch.zeros(0, self.seq_len, dtype=torch.int64, device=self.device)  # [W', S] not yet used
        self.epochs = 0
        self.windows_per_epoch = 0  # of the latest packing (it varies by a few windows with the order)

    @property
    def num_units(self) -> int:
        return int(self.starts.size)

    def epoch_index(self) -> np.ndarray:
        """[W, S] token index of one epoch's packing (N where a window is padded)."""
        order = self.rng.permutation(self.num_units)
        dest = pack_order(self.lengths, order, self.seq_len)
        num_windows = int(dest.max()) // self.seq_len + 1
        self.windows_per_epoch = num_windows
        index = np.full(num_windows * self.seq_len, self.num_tokens, dtype=np.int64)
        within = np.arange(int(self.lengths.sum())) - np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
        index[np.repeat(dest, self.lengths) + within] = np.repeat(self.starts, self.lengths) + within
        return index.reshape(num_windows, self.seq_len)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ids [B, S] int64, loss mask [B, S] float32) on the device."""
        while self.pending.shape[0] < self.batch_size:
            fresh = torch.from_numpy(self.epoch_index()).to(self.device, non_blocking=True)
            self.pending = torch.cat([self.pending, fresh])
            self.epochs += 1
        index, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size:]
        return self.ids[index].long(), self.mask[index].float()

    def passes(self, windows_used: int) -> float:
        """Passes over the split that `windows_used` windows make."""
        return windows_used / max(1, self.windows_per_epoch)
