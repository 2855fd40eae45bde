"""Per-sequence slots of the attention worker: the fixed-size state of each running sequence.

A slot (index `seq_slot`, chosen by the router) holds the sequence's `SequenceState` (window
ring and open compressor inputs live in it; its compressed rows live in the KV pool's blocks,
reached through the slot's `BlockTable`), its sampling parameters and seed, and the token ids
the penalties need. A slot is (re)initialised when a plan schedules a new request_id in it or
a sequence from position 0, and released by `free_seq_slots`. `restore` initialises a slot
at a block boundary from blocks and the resume snapshot of that boundary (a prefix-cache hit or
a swap-in, `boundary.py`); the plan that restores also schedules the sequence from that
boundary, with its sampling params. Each plan names the snapshots the sequence's step writes
(`snapshot_targets`: the block ends it crosses that the router wants to resume from).
A restored slot never rolls back below its restore point (those blocks may be shared).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from moemesh.common.model.config import ModelConfig
from moemesh.common.model.state import SequenceState
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.boundary import Recorder, recording_state, restore_state
from moemesh.services.attention.kv_pool import BlockTable, KVPool


class SlotError(ValueError):
    """A plan that does not fit the slot's state (wrong position, missing sampling params)."""


@dataclass
class Slot:
    request_id: str
    state: SequenceState
    table: BlockTable
    recorder: Recorder
    params: SamplingParams | None  # None only between a restore and the schedule that carries them
    seed: int | None  # None for greedy requests
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt length from the router; None (an older sender): tokens before the first output are the prompt.
    num_prompt_tokens: int | None = None
    # Position of prompt_token_ids[0]: 0 once the router sent the history, else where recording began.
    first_recorded_position: int = 0
    # The HTTP request (X-Request-Id) the sequence belongs to, for log events; None: not sent.
    client_request_id: str | None = None

    def begin_history(self, start_position: int, prior_token_ids: tuple[int, ...] | list[int],
                      num_prompt_tokens: int | None) -> None:
        """A sequence starting in this slot at start_position (0, or a restored boundary) with the
        tokens before it; prompt and outputs are split by num_prompt_tokens, so the output count (the
        index of a seeded request's next random stream) and the penalties' history are what they were
        before a preemption."""
        if len(prior_token_ids) > start_position:
            raise SlotError(f"{self.request_id}: {len(prior_token_ids)} prior tokens before position {start_position}")
        if num_prompt_tokens is not None and num_prompt_tokens < 0:
            raise SlotError(f"{self.request_id}: negative prompt length {num_prompt_tokens}")
        self.num_prompt_tokens = num_prompt_tokens
        self.first_recorded_position = start_position - len(prior_token_ids)
        self.prompt_token_ids.clear()
        self.output_token_ids.clear()
        self.record_tokens(self.first_recorded_position, prior_token_ids)

    def record_tokens(self, start_position: int, token_ids) -> None:
        """Note the known (non-draft) tokens computed at start_position..; tokens already recorded
        (the last sampled token, fed back as the next step's input) are skipped."""
        position = self.first_recorded_position + len(self.prompt_token_ids) + len(self.output_token_ids)
        skip = position - start_position
        if skip < 0:
            raise SlotError(f"{self.request_id}: tokens at {start_position}, history ends at {position}")
        for token in list(token_ids)[skip:]:
            if self.num_prompt_tokens is None:
                is_prompt = not self.output_token_ids
            else:
                is_prompt = position < self.num_prompt_tokens
            (self.prompt_token_ids if is_prompt else self.output_token_ids).append(int(token))
            position += 1


class SlotTable:
    def __init__(self, model_config: ModelConfig, pool: KVPool, dtype: torch.dtype, device: torch.device) -> None:
        self.model_config = model_config
        self.pool = pool
        self.dtype = dtype
        self.device = device
        self.slots: dict[int, Slot] = {}

    def _new_slot(self, seq_slot: int, request_id: str) -> Slot:
        table = BlockTable(self.device)
        recorder = Recorder(self.pool, table)
        state = recording_state(self.model_config, self.pool, table, recorder, self.dtype, self.device)
        slot = Slot(request_id, state, table, recorder, None, None)
        self.slots[seq_slot] = slot
        return slot

    def restore(self, seq_slot: int, request_id: str, block_ids: tuple[int, ...], num_tokens: int,
                snapshot_id: int) -> Slot:
        """A fresh slot standing at the block boundary num_tokens, rebuilt from block_ids (its
        first num_tokens / block_size blocks, already in the primary tier) and the resume snapshot
        snapshot_id of that boundary (primary tier)."""
        size = self.pool.config.block_size_tokens
        if num_tokens <= 0 or num_tokens % size or len(block_ids) * size != num_tokens:
            raise SlotError(f"{request_id}: restore of {num_tokens} tokens from {len(block_ids)} blocks "
                            f"of {size} tokens")
        self.slots.pop(seq_slot, None)
        slot = self._new_slot(seq_slot, request_id)
        slot.table.update(block_ids)
        try:
            restore_state(slot.state, slot.recorder, num_tokens, snapshot_id)
        except Exception:
            self.slots.pop(seq_slot, None)
            raise
        return slot

    def prepare(self, seq_slot: int, request_id: str, start_position: int, block_ids: tuple[int, ...],
                sampling: dict | None, snapshot_targets=()) -> Slot:
        """The slot for this step's share of a sequence, positioned at start_position; snapshot_targets:
        (block index, snapshot id) pairs, the resume snapshots this step writes when it crosses their block ends."""
        slot = self.slots.get(seq_slot)
        if slot is None or slot.request_id != request_id or start_position == 0:
            if sampling is None:
                raise SlotError(f"{request_id}: first schedule of a sequence must carry its sampling params")
            slot = self._new_slot(seq_slot, request_id)
        if slot.params is None:
            if sampling is None:
                raise SlotError(f"{request_id}: first schedule of a sequence must carry its sampling params")
            slot.params = SamplingParams.from_wire(sampling)
            slot.seed = None if slot.params.is_greedy else (
                slot.params.seed if slot.params.seed is not None else secrets.randbits(63))
        if start_position < slot.recorder.num_sealed_tokens:
            raise SlotError(f"{request_id}: position {start_position} is below its restore point "
                            f"{slot.recorder.num_sealed_tokens}")
        if start_position < slot.state.num_tokens:
            slot.state.rollback(slot.state.num_tokens - start_position)  # rejected drafts
        if start_position != slot.state.num_tokens:
            raise SlotError(f"{request_id}: scheduled at position {start_position}, its state is at "
                            f"{slot.state.num_tokens}")
        slot.table.update(block_ids)
        slot.recorder.set_targets(snapshot_targets)
        return slot

    def free(self, seq_slots) -> None:
        for seq_slot in seq_slots:
            self.slots.pop(seq_slot, None)
