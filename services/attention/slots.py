"""Per-sequence slots of the attention worker: the fixed-size state of each running sequence.

A slot (index `seq_slot`, chosen by the router) holds the sequence's `SequenceState` (window
ring and open compressor inputs live in it; its compressed rows live in the KV pool's blocks,
reached through the slot's `BlockTable`), its sampling parameters and seed, and the token ids
the penalties need. A slot is (re)initialised when a plan schedules a new request_id in it or
a sequence from position 0, and released by `free_seq_slots`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from common.model.config import ModelConfig
from common.model.state import SequenceState
from common.sampling_params import SamplingParams
from services.attention.kv_pool import BlockTable, KVPool


class SlotError(ValueError):
    """A plan that does not fit the slot's state (wrong position, missing sampling params)."""


@dataclass
class Slot:
    request_id: str
    state: SequenceState
    table: BlockTable
    params: SamplingParams
    seed: int | None  # None for greedy requests
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


class SlotTable:
    def __init__(self, model_config: ModelConfig, pool: KVPool, dtype: torch.dtype, device: torch.device) -> None:
        self.model_config = model_config
        self.pool = pool
        self.dtype = dtype
        self.device = device
        self.slots: dict[int, Slot] = {}

    def prepare(self, seq_slot: int, request_id: str, start_position: int, block_ids: tuple[int, ...],
                sampling: dict | None) -> Slot:
        """The slot for this step's share of a sequence, positioned at start_position."""
        slot = self.slots.get(seq_slot)
        if slot is None or slot.request_id != request_id or start_position == 0:
            if sampling is None:
                raise SlotError(f"{request_id}: first schedule of a sequence must carry its sampling params")
            params = SamplingParams.from_wire(sampling)
            seed = None if params.is_greedy else (params.seed if params.seed is not None else secrets.randbits(63))
            table = BlockTable(self.device)
            state = SequenceState(self.model_config, dtype=self.dtype, device=self.device,
                                  row_store_factory=self.pool.row_store_factory(table))
            slot = Slot(request_id, state, table, params, seed)
            self.slots[seq_slot] = slot
        if start_position < slot.state.num_tokens:
            slot.state.rollback(slot.state.num_tokens - start_position)  # rejected drafts
        if start_position != slot.state.num_tokens:
            raise SlotError(f"{request_id}: scheduled at position {start_position}, its state is at "
                            f"{slot.state.num_tokens}")
        slot.table.update(block_ids)
        return slot

    def free(self, seq_slots) -> None:
        for seq_slot in seq_slots:
            self.slots.pop(seq_slot, None)
