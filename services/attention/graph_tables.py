"""Static step tables: the attention kernels' per-step metadata in fixed device buffers.

A captured CUDA graph replays kernel launches with the arguments and grid they were captured with.
The eager `AttentionTables` (common/kernels/attention_layout.py) are rebuilt per forward, and three
of their host figures change with the positions: the number of tokens closing a compression window
(grid of the pooling and row writes), the most closed rows any token sees (indexer score width,
whether the indexer runs at all, the split plan of sparse attention) and the largest position (the
split plan). `StaticDecodeTables` removes each one for steps of short chunks (decode: one new token
per sequence; speculative verification: the seed and its drafts, a few tokens per sequence):
- every table (`fields`, `seq_info`, `positions`, `block_ids`, `token_seq`, the token ids, the split
  sizes) is a view of one flat int64 device buffer, refilled from a pinned host mirror by one copy
  before each replay (`fill`; `token_seq` then goes to its int32 buffer by one device copy);
- the window-closing compression is predicated on the device (`closing_predicated`): every token
  has a pooling program, the kernels test (pos + 1) mod m == 0 and only closing tokens write rows;
  the kernels read each sequence's chunk (start, first token, length) from `seq_info`, so several
  tokens of one sequence see each other causally, as in an eager forward;
- sparse attention launches the most splits any step can plan (`SparseAttentionConfig.max_splits`)
  and reads the split size the host planned for this step from `split_sizes` (the same
  `plan_splits` the eager launch uses, so the keys each split covers are the eager ones; splits
  past the keys are empty and contribute exact zeros to the combine);
- the indexer scores `index_rows` columns, a capacity class fixed per set of graphs (None: no token
  sees more than top-k rows and the indexer is skipped, as eagerly); the host picks the class per
  step from the real sequences (`index_rows_class`).
Token rows past the real tokens are padding: each its own scratch sequence at position 0 (it closes no
window and reads no compressed row; its ring writes land in the scratch stores). Sequence entries past
those (a step of multi-token chunks has fewer sequences than token rows) are empty: length 0, the
scratch sequence's fields, no token reads them and the kernels gridded over sequences do nothing there.
Legend: L layers, Tb bucket tokens (rows), F fields, NB block-table width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.common.kernels.attention_layout import NUM_FIELDS, AttentionTables, IndexerRowBytes, MainRowBytes
from moemesh.common.model.attention_tables import sequence_addresses
from moemesh.common.model.config import AttentionKind, ModelConfig
from moemesh.common.model.state import SequenceState


def index_rows_class(max_rows_visible: int, topk: int) -> int | None:
    """Indexer score width for a step whose tokens see at most `max_rows_visible` CSA rows: None while
    no token sees more than top-k (the indexer does not run), else a power of two >= the rows (and
    >= 4·top-k), so that a captured set serves every context length up to it."""
    if max_rows_visible <= topk:
        return None
    width = 1 << (max_rows_visible - 1).bit_length()
    return max(width, 4 * topk)


@dataclass(frozen=True)
class SplitKey:
    """The layers sharing one sparse-attention split plan: window, ratio (0: window only), top-k (None: all rows)."""

    window: int
    ratio: int
    topk: int | None


def split_keys(config: ModelConfig) -> tuple[SplitKey, ...]:
    keys = []
    for layer, kind in enumerate(config.layer_types):
        ratio = config.compress_ratio(layer) if kind is not AttentionKind.WINDOW else 0
        key = SplitKey(config.sliding_window, ratio, config.index_topk if kind is AttentionKind.CSA else None)
        if key not in keys:
            keys.append(key)
    return tuple(keys)


class StaticDecodeTables(AttentionTables):
    """Tables of a captured decode step over `num_tokens` rows (see the module docstring)."""

    closing_predicated = True

    def __init__(self, config: ModelConfig, num_tokens: int, rows_per_block: dict[tuple[int, str], int],
                 block_width: int, index_rows: int | None, state_dtype: torch.dtype, device: torch.device,
                 min_real_tokens: int = 1, main_rows: MainRowBytes | None = None,
                 indexer_rows: IndexerRowBytes | None = None) -> None:
        """min_real_tokens: the fewest real tokens a step over these tables has (the previous bucket + 1);
        main_rows / indexer_rows: the FP8 layouts of the window and compressed rows / of the indexer rows (None:
        rows in state_dtype)."""
        self.config = config
        self.min_real_tokens = min_real_tokens
        self.index_rows = index_rows
        self.split_key_order = split_keys(config)
        num_layers = config.num_hidden_layers
        block_width = max(1, block_width) + 1  # one spare column: predicated lookups never leave the table
        sizes = {"fields": num_layers * num_tokens * NUM_FIELDS, "seq_info": num_tokens * 3, "positions": num_tokens,
                 "block_ids": num_tokens * block_width, "split_sizes": len(self.split_key_order),
                 "token_ids": num_tokens, "token_seq": num_tokens}
        self.host = torch.zeros(sum(sizes.values()), dtype=torch.int64,
                                pin_memory=device.type == "cuda")  # the pinned mirror `fill` writes
        self.flat = torch.zeros_like(self.host, device=device)  # [sum] int64: every table is a view of it
        host_views, device_views, offset = {}, {}, 0
        for name, size in sizes.items():
            host_views[name], device_views[name] = self.host[offset: offset + size], self.flat[offset: offset + size]
            offset += size
        self._host = host_views
        shape = {"fields": (num_layers, num_tokens, NUM_FIELDS), "seq_info": (num_tokens, 3),
                 "block_ids": (num_tokens, block_width)}
        for name, dims in shape.items():
            host_views[name] = host_views[name].view(*dims)
            device_views[name] = device_views[name].view(*dims)
        token_seq = torch.arange(num_tokens, dtype=torch.int32, device=device)  # [Tb] int32, refilled by `fill`
        closing = torch.arange(num_tokens, dtype=torch.int64, device=device)
        ratios = {config.compress_ratio(layer) for layer, kind in enumerate(config.layer_types)
                  if kind is not AttentionKind.WINDOW}
        csa_rows = index_rows if index_rows is not None else config.index_topk
        super().__init__(device_views["fields"], device_views["seq_info"], token_seq, device_views["positions"],
                         device_views["block_ids"], rows_per_block, {ratio: (closing, num_tokens) for ratio in ratios},
                         {ratio: csa_rows for ratio in ratios}, 0, state_dtype, main_rows=main_rows,
                         indexer_rows=indexer_rows)
        self.token_ids = device_views["token_ids"]  # [Tb] int64: the step's input tokens
        self._token_seq_wide = device_views["token_seq"]  # [Tb] int64, copied into the kernels' int32 token_seq
        self.split_sizes = device_views["split_sizes"]  # [keys] int64
        self._copy_done: torch.cuda.Event | None = None
        self._row_signatures: list[tuple | None] = [None] * num_tokens  # what each mirror row holds

    def device_split_size(self, window: int, ratio: int, topk: int | None) -> torch.Tensor:
        index = self.split_key_order.index(SplitKey(window, ratio, topk))
        return self.split_sizes[index: index + 1]

    def fill(self, states: list[SequenceState], token_ids: torch.Tensor | None, scratch: SequenceState,
             num_new_tokens: list[int] | None = None) -> None:
        """Write one step's metadata (`states[i]` gets its next `num_new_tokens[i]` tokens, default 1 each, whose
        ids are `token_ids` in sequence order, a device tensor copied device to device, no host sync; token rows
        past them are padding) and copy it to the device buffers, in stream order.

        The caller checked addressability, geometry and that the tokens fit (`DecodeGraphs._key`)."""
        from moemesh.common.kernels.sparse_attention_plan import choose_num_splits, default_config, plan_splits

        if self._copy_done is not None:  # the previous step's copy must have read the mirror
            self._copy_done.synchronize()
        host = self._host
        num_real = len(states)
        counts = [1] * num_real if num_new_tokens is None else list(num_new_tokens)
        num_tokens = self.token_ids.shape[0]
        num_real_tokens = sum(counts)
        if len(counts) != num_real or num_real_tokens > num_tokens or min(counts, default=1) < 1:
            raise ValueError(f"{num_real_tokens} tokens of {num_real} sequences ({counts}) for {num_tokens} rows")
        num_padding = num_tokens - num_real_tokens
        scratch_fields = sequence_addresses(scratch).fields  # [L, F]
        starts = [state.num_tokens for state in states]
        for index in range(num_tokens):  # sequence entries: the real ones, then padding, then empty ones
            addresses = sequence_addresses(states[index]) if index < num_real else None
            ids = addresses.block_table.block_ids if addresses is not None and addresses.paged else ()
            # the mirror keeps the last step's rows: rewrite only what changed (same sequence, layout, blocks)
            last = self._row_signatures[index]  # (fields tensor, block ids): holding the tensor keeps `is` sound
            if addresses is not None and last is not None and last[0] is addresses.fields and last[1] == ids:
                continue
            self._row_signatures[index] = (addresses.fields, ids) if addresses is not None else None
            host["fields"][:, index] = addresses.fields if addresses is not None else scratch_fields
            if ids:
                host["block_ids"][index, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        seq_info, token_seq, positions = [], [], []
        for index, (start, count) in enumerate(zip(starts, counts)):
            seq_info.append((start, len(positions), count))
            token_seq.extend([index] * count)
            positions.extend(range(start, start + count))
        for index in range(num_real, num_real + num_padding):  # padding: one scratch token each, at position 0
            seq_info.append((0, len(positions), 1))
            token_seq.append(index)
            positions.append(0)
        seq_info.extend([(0, 0, 0)] * (num_tokens - len(seq_info)))  # empty sequences
        host["seq_info"].copy_(torch.tensor(seq_info, dtype=torch.int64))
        host["token_seq"].copy_(torch.tensor(token_seq, dtype=torch.int64))
        host["positions"].copy_(torch.tensor(positions, dtype=torch.int64))
        host["token_ids"].zero_()
        config = self.config
        num_heads = config.num_attention_heads
        plan_tokens = num_real_tokens or self.min_real_tokens  # (no real rows: the warm-up before a capture)
        last_positions = [start + count - 1 for start, count in zip(starts, counts)] or [0]
        max_position = max(last_positions)
        fp8_rows = self.main_rows is not None
        sparse_config = default_config(plan_tokens, fp8_rows)
        if sparse_config != default_config(num_tokens, fp8_rows):
            raise ValueError(f"{num_real_tokens} and {num_tokens} tokens plan sparse attention differently")
        for index, key in enumerate(self.split_key_order):
            if key.ratio:
                max_rows = max((p + 1) // key.ratio for p in last_positions)
                max_rows = min(max_rows, key.topk) if key.topk is not None else max_rows
            else:
                max_rows = 0
            max_keys = min(key.window, max_position + 1) + max_rows
            plan = plan_splits(plan_tokens, num_heads, max_keys, sparse_config)
            capacity = choose_num_splits(self.min_real_tokens, plan.num_head_blocks, 1 << 40, sparse_config)
            if plan.num_splits > capacity:  # cannot happen for num_real_tokens >= min_real_tokens
                raise ValueError(f"{plan.num_splits} splits planned for {plan_tokens} tokens, the graph has {capacity}")
            host["split_sizes"][index] = plan.keys_per_split
        self.flat.copy_(self.host, non_blocking=True)
        self.token_seq.copy_(self._token_seq_wide)  # int64 -> the kernels' int32, on the device
        if token_ids is not None:
            self.token_ids[:num_real_tokens].copy_(token_ids)
        if self.flat.is_cuda:
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
