"""A simulated attention worker over integers: executes step plans and checks the contract.

It is the executable statement of what a plan promises the real worker, used by the
scheduler tests. Instead of KV tensors, every written
position of a block holds a fingerprint of the token there and of every token before it
(a rolling hash), a resume snapshot holds the fingerprint at the block end it was recorded at,
and a state slot holds how far its sequence has advanced. With checking on, it verifies on
every step that:
  - a scheduled sequence owns its state slot, and the slot stands exactly at start_position
    (a fresh slot at 0, or at the restore boundary);
  - the block table covers every position computed, and blocks of positions before
    start_position hold exactly the request's tokens (so swaps, prefix hits and rollbacks
    never corrupt or lose KV);
  - no block is written by one sequence while another sequence's table holds it;
  - a restore's snapshot was recorded at that block end after exactly the request's tokens
    (so snapshot targets, rollbacks, swaps and the snapshot cache never resume from the wrong
    state), and every snapshot target lies at a block end the step crosses;
  - copies run in the documented order (swap_out, swap_in, restores, compute).
Tokens come from a deterministic "target model": the token after position p is a function
of the fingerprint at p; drafts are verified greedily (exact match plus a bonus token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moemesh.services.router.scheduler.config import SchedulerConfig
from moemesh.services.router.scheduler.output import SchedulerOutput, SequenceResult

_ROOT_FINGERPRINT = 0x5EED


def next_fingerprint(previous: int, token_id: int) -> int:
    return hash((previous, token_id))


def fingerprints_of(token_ids: Sequence[int]) -> list[int]:
    """fingerprints[p] covers tokens 0..p."""
    out = []
    previous = _ROOT_FINGERPRINT
    for token_id in token_ids:
        previous = next_fingerprint(previous, token_id)
        out.append(previous)
    return out


class ContractViolation(AssertionError):
    """A plan asked the worker for something a correct worker could not do correctly."""


class SimulatedWorker:
    def __init__(
        self,
        config: SchedulerConfig,
        known_token_ids: Callable[[str], Sequence[int]],
        *,
        vocab_size: int = 1000,
        check: bool = True,
    ) -> None:
        """known_token_ids(request_id) gives a request's prompt + output ids so far (the truth
        the KV contents are checked against)."""
        self.block_size = config.block_size_tokens
        self.vocab_size = vocab_size
        self.check = check
        self.known_token_ids = known_token_ids
        self.gpu_blocks: list[list[int | None]] = [[None] * self.block_size for _ in range(config.num_gpu_blocks)]
        self.cpu_blocks: list[list[int | None]] = [[None] * self.block_size for _ in range(config.num_cpu_blocks)]
        self.gpu_snapshots: list[int | None] = [None] * config.num_gpu_snapshots
        self.cpu_snapshots: list[int | None] = [None] * config.num_cpu_snapshots
        # slot -> (request_id, position the state stands at, fingerprint of the last token)
        self.slots: dict[int, tuple[str, int, int]] = {}
        self.num_steps = 0

    def target_token(self, fingerprint: int) -> int:
        """The token the target model samples after the prefix with this fingerprint."""
        return hash((fingerprint, "next")) % self.vocab_size

    # -- one step ------------------------------------------------------------------------
    def execute(self, plan: SchedulerOutput) -> dict[str, SequenceResult]:
        self.num_steps += 1
        for request_id in plan.freed_request_ids + plan.preempted_request_ids:
            self._release_slot_of(request_id)
        for gpu_block, cpu_block in plan.swap_out:
            self.cpu_blocks[cpu_block] = list(self.gpu_blocks[gpu_block])
        for gpu_snapshot, cpu_snapshot in plan.snapshot_swap_out:
            self.cpu_snapshots[cpu_snapshot] = self.gpu_snapshots[gpu_snapshot]
        for cpu_block, gpu_block in plan.swap_in:
            self.gpu_blocks[gpu_block] = list(self.cpu_blocks[cpu_block])
        for cpu_snapshot, gpu_snapshot in plan.snapshot_swap_in:
            self.gpu_snapshots[gpu_snapshot] = self.cpu_snapshots[cpu_snapshot]
        restored_slots = set()
        for restore in plan.state_restores:
            self._restore(restore.request_id, restore.state_slot, restore.block_ids, restore.num_restored_tokens,
                          restore.snapshot_id)
            restored_slots.add(restore.state_slot)
        if self.check:
            self._check_no_shared_writes(plan)
        results = {}
        for seq in plan.scheduled:
            if seq.is_new_sequence and seq.state_slot not in restored_slots:
                self._claim_slot(seq.request_id, seq.state_slot, 0, _ROOT_FINGERPRINT)
            result = self._compute(seq)
            if result is not None:
                results[seq.request_id] = result
        return results

    def _compute(self, seq) -> SequenceResult | None:
        owner, position, fingerprint = self.slots.get(seq.state_slot, (None, None, None))
        if owner != seq.request_id:
            raise ContractViolation(f"{seq.request_id}: slot {seq.state_slot} belongs to {owner}")
        if position != seq.start_position:
            raise ContractViolation(
                f"{seq.request_id}: state at {position}, plan starts at {seq.start_position}"
            )
        end = seq.start_position + seq.num_tokens
        if len(seq.block_ids) * self.block_size < end:
            raise ContractViolation(f"{seq.request_id}: {len(seq.block_ids)} blocks for {end} positions")
        if self.check:
            self._check_prefix(seq.request_id, seq.block_ids, seq.start_position)
        per_position = []  # fingerprint after each computed token
        for offset, token_id in enumerate(seq.token_ids):
            fingerprint = next_fingerprint(fingerprint, token_id)
            position = seq.start_position + offset
            self.gpu_blocks[seq.block_ids[position // self.block_size]][position % self.block_size] = fingerprint
            per_position.append(fingerprint)
        for block_index, snapshot in seq.snapshot_targets:
            boundary = (block_index + 1) * self.block_size
            if not seq.start_position < boundary <= end:
                raise ContractViolation(f"{seq.request_id}: snapshot target at {boundary} outside the step "
                                        f"({seq.start_position} .. {end})")
            self.gpu_snapshots[snapshot] = per_position[boundary - 1 - seq.start_position]
        if not seq.sample_logits:
            self.slots[seq.state_slot] = (seq.request_id, end, fingerprint)
            return None
        # Greedy verification: the target's token after the last known token, then after each
        # accepted draft; stop at the first draft that differs.
        num_known = seq.num_tokens - len(seq.draft_token_ids)
        sampled = []
        for index in range(len(seq.draft_token_ids) + 1):
            token = self.target_token(per_position[num_known - 1 + index])
            sampled.append(token)
            if index == len(seq.draft_token_ids) or seq.draft_token_ids[index] != token:
                break
        num_accepted = len(sampled) - 1
        kept = num_known + num_accepted
        # Roll the state back over the rejected drafts (their block rows are simply stale).
        self.slots[seq.state_slot] = (seq.request_id, seq.start_position + kept, per_position[kept - 1])
        return SequenceResult(tuple(sampled), num_accepted)

    # -- slots and restores ---------------------------------------------------------------
    def _claim_slot(self, request_id: str, slot: int, position: int, fingerprint: int) -> None:
        owner = self.slots.get(slot)
        if owner is not None and owner[0] != request_id:
            raise ContractViolation(f"slot {slot} given to {request_id} while {owner[0]} holds it")
        self.slots[slot] = (request_id, position, fingerprint)

    def _release_slot_of(self, request_id: str) -> None:
        for slot, (owner, _, _) in list(self.slots.items()):
            if owner == request_id:
                del self.slots[slot]

    def _restore(self, request_id: str, slot: int, block_ids, num_tokens: int, snapshot: int) -> None:
        if num_tokens % self.block_size or len(block_ids) * self.block_size != num_tokens:
            raise ContractViolation(f"{request_id}: restore of {num_tokens} tokens from {len(block_ids)} blocks")
        self._check_prefix(request_id, block_ids, num_tokens)
        last = self.gpu_blocks[block_ids[-1]][self.block_size - 1]
        if self.gpu_snapshots[snapshot] != last:
            raise ContractViolation(f"{request_id}: snapshot {snapshot} was not recorded at {num_tokens} after "
                                    f"its tokens")
        self._claim_slot(request_id, slot, num_tokens, last)

    # -- checks ---------------------------------------------------------------------------
    def _check_prefix(self, request_id: str, block_ids, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        expected = fingerprints_of(self.known_token_ids(request_id)[:num_tokens])
        if len(expected) < num_tokens:
            raise ContractViolation(f"{request_id}: {num_tokens} positions claimed, {len(expected)} known")
        for position in range(num_tokens):
            stored = self.gpu_blocks[block_ids[position // self.block_size]][position % self.block_size]
            if stored != expected[position]:
                raise ContractViolation(f"{request_id}: KV at position {position} is wrong or missing")

    def _check_no_shared_writes(self, plan: SchedulerOutput) -> None:
        holders: dict[int, set[str]] = {}
        for seq in plan.scheduled:
            for block_id in seq.block_ids:
                holders.setdefault(block_id, set()).add(seq.request_id)
        for seq in plan.scheduled:
            first = seq.start_position // self.block_size
            last = (seq.start_position + seq.num_tokens - 1) // self.block_size
            for block_id in seq.block_ids[first : last + 1]:
                if len(holders[block_id]) > 1:
                    raise ContractViolation(f"{seq.request_id} writes block {block_id} shared with {holders[block_id]}")
