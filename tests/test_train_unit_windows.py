"""Per-epoch packing of the training units (tools/train/unit_windows.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moemesh.tools.corpus.special_tokens import BOS_ID, EOS_ID, PAD_ID
from moemesh.tools.train.unit_windows import UnitWindows, unit_spans

SEQ_LEN = 16


def _stored_split(unit_lengths: list[int], seq_len: int = SEQ_LEN) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Units [BOS, tokens.., EOS] with distinct token ids, packed once as the dataset stores them."""
    units, masks, next_id = [], [], 100
    for length in unit_lengths:
        body = np.arange(next_id, next_id + length - 2)
        next_id += length
        units.append(np.concatenate([[BOS_ID], body, [EOS_ID]]).astype(np.uint16))
        masks.append((np.arange(length) >= length // 2).astype(np.uint8))
    flat = np.concatenate(units)
    flat_mask = np.concatenate(masks)
    num_windows = -(-flat.size // seq_len)
    ids = np.full(num_windows * seq_len, PAD_ID, np.uint16)
    mask = np.zeros(num_windows * seq_len, np.uint8)
    ids[: flat.size], mask[: flat.size] = flat, flat_mask
    return ids.reshape(-1, seq_len), mask.reshape(-1, seq_len), units


def _windows_of_epoch(stream: UnitWindows) -> tuple[np.ndarray, np.ndarray]:
    index = torch.from_numpy(stream.epoch_index())
    return stream.ids[index].numpy(), stream.mask[index].numpy()


def _units_in(window: np.ndarray) -> list[tuple[int, ...]]:
    """The units of one packed window, split at BOS, padding dropped."""
    tokens = window[window != PAD_ID]
    starts = np.flatnonzero(tokens == BOS_ID)
    return [tuple(int(t) for t in part) for part in np.split(tokens, starts[1:])]


def test_unit_spans_split_at_bos_and_cut_units_longer_than_a_window():
    flat = np.array([BOS_ID, 5, 6, BOS_ID, 7, 8, 9, 10, 11, BOS_ID, 12], np.uint16)
    starts, lengths = unit_spans(flat, seq_len=4)
    assert starts.tolist() == [0, 3, 7, 9]
    assert lengths.tolist() == [3, 4, 2, 2]


def test_a_split_that_does_not_start_with_bos_is_refused():
    with pytest.raises(ValueError, match="must start with BOS"):
        unit_spans(np.array([7, BOS_ID, 5], np.uint16), seq_len=4)


def test_every_epoch_holds_every_unit_once_whole_in_one_window_with_its_loss_mask():
    ids, mask, units = _stored_split([5, 9, 3, 16, 7, 4, 11, 6, 3, 8, 13, 5])
    stored_mask = {tuple(int(t) for t in u): (np.arange(u.size) >= u.size // 2).astype(np.uint8) for u in units}
    stream = UnitWindows((ids, mask), ids.shape[1], batch_size=2, seed=3, device="cpu")
    for _ in range(3):
        windows, masks = _windows_of_epoch(stream)
        found = sorted(u for window in windows for u in _units_in(window))
        assert found == sorted(stored_mask)
        for window, window_mask in zip(windows, masks, strict=True):
            assert int(window[0]) == BOS_ID  # every window starts with a whole unit
            assert not window_mask[window == PAD_ID].any()  # padding carries no loss
            for unit in _units_in(window):
                start = int(np.flatnonzero(window == unit[1])[0]) - 1  # body ids are unique
                assert window_mask[start:start + len(unit)].tolist() == stored_mask[unit].tolist()


def test_units_get_other_neighbours_from_one_epoch_to_the_next():
    ids, mask, units = _stored_split([4 + (7 * k) % 9 for k in range(60)], seq_len=32)
    stream = UnitWindows((ids, mask), ids.shape[1], batch_size=4, seed=0, device="cpu")

    def predecessors() -> dict[int, int]:
        windows, _ = _windows_of_epoch(stream)
        before = {}
        for window in windows:
            parts = _units_in(window)
            for prev, unit in zip(parts, parts[1:]):
                before[unit[1]] = prev[1]
        return before

    first, second = predecessors(), predecessors()
    shared = set(first) & set(second)
    assert len(shared) > 20
    assert sum(first[u] == second[u] for u in shared) < len(shared) // 4


def test_batches_are_seeded_and_count_passes():
    ids, mask, _ = _stored_split([5, 9, 3, 16, 7, 4, 11, 6, 2, 8, 13, 5])

    def batches(seed: int) -> list[np.ndarray]:
        stream = UnitWindows((ids, mask), ids.shape[1], batch_size=3, seed=seed, device="cpu")
        out = [stream.next_batch()[0].numpy() for _ in range(6)]
        assert stream.epochs >= 2 and stream.passes(stream.windows_per_epoch) == 1.0
        return out

    a, b, c = batches(1), batches(1), batches(2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    assert a[0].shape == (3, SEQ_LEN) and a[0].dtype == np.int64
