"""Which copy of an expert serves a dispatch: replicas by least outstanding work or in turn, and
workers marked down.

A placement gives every (layer, expert) one or more holders (expert worker indices of the
channel, primary copy first). `ReplicaRouter` keeps that table plus the set of workers the
attention worker has seen fail, and answers one question per MoE layer and micro-batch: for
each expert of the layer, which live holder gets its tokens this time.

Policies (`ReplicaPolicy`):
- `least_loaded` (default): the experts with one live holder are assigned first (they have no
  choice); then the replicated experts, most tokens first, each go to the live holder with the
  least outstanding work: expert-slot tokens already in flight to that worker (from another
  micro-batch whose Combine has not been received yet) plus what this dispatch has given it so
  far. Ties go to the lower worker index, so the choice is deterministic for given counts.
- `round_robin`: the k-th dispatch gives a replicated expert to live holder k mod copies.

Outputs do not depend on the choice: every copy holds the same weights, and in
placement-invariant mode the attention worker adds the slots in expert-id order whatever worker
computed them (in partial-sum mode with top-k > 2, to rounding; see moe_dispatch.py).

Down workers: `mark_down(w)` removes w from every pair's live holders. A pair whose holders are
all down is *unserved*: its tokens still go to its first holder (the dispatch then fails again,
and recovery waits for the restarted worker), and `all_served` is False. `mark_up(w)` undoes
it once the worker answers again with its pairs loaded. Pure Python, no torch.
Legend: L layers, E routed experts, W expert workers (channel indices).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

Holders = tuple[int, ...]  # worker indices holding one (layer, expert), primary first


class ReplicaPolicy(StrEnum):
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class ReplicaRouter:
    def __init__(self, holders: Sequence[Sequence[Sequence[int]]],
                 policy: ReplicaPolicy = ReplicaPolicy.LEAST_LOADED) -> None:
        """holders [L][E] -> worker indices (primary first); every pair needs at least one."""
        self.policy = ReplicaPolicy(policy)
        self.holders: list[list[Holders]] = [[tuple(dict.fromkeys(h)) for h in row] for row in holders]
        for layer, row in enumerate(self.holders):
            for expert, copies in enumerate(row):
                if not copies:
                    raise ValueError(f"(layer {layer}, expert {expert}) has no holder")
        self.down: set[int] = set()
        self.version = 0  # bumped on every change of the live table (the dispatcher re-uploads it)
        self._turn = 0
        self._rebuild()

    @classmethod
    def from_owner_tables(cls, tables: Sequence[Sequence[Sequence[int]]],
                          policy: ReplicaPolicy = ReplicaPolicy.LEAST_LOADED) -> "ReplicaRouter":
        """From R tables [L][E] (table r: the r-th copy in turn): holders = the distinct owners in table order."""
        num_layers, num_experts = len(tables[0]), len(tables[0][0])
        holders = [[tuple(dict.fromkeys(table[layer][expert] for table in tables)) for expert in range(num_experts)]
                   for layer in range(num_layers)]
        return cls(holders, policy)

    # ------------------------------------------------------------------ state
    @property
    def num_layers(self) -> int:
        return len(self.holders)

    @property
    def num_experts(self) -> int:
        return len(self.holders[0]) if self.holders else 0

    @property
    def num_workers(self) -> int:
        return 1 + max((w for row in self.holders for copies in row for w in copies), default=-1)

    def _rebuild(self) -> None:
        self.live: list[list[Holders]] = [[tuple(w for w in copies if w not in self.down) for copies in row]
                                          for row in self.holders]
        # base[l][e]: the first live holder, else the first holder (unserved: dispatching there fails again)
        self.base: list[list[int]] = [[(live[0] if live else copies[0]) for live, copies in zip(lrow, hrow)]
                                      for lrow, hrow in zip(self.live, self.holders)]
        self.replicated: list[list[int]] = [[e for e, live in enumerate(row) if len(live) > 1] for row in self.live]
        self.unserved: list[tuple[int, int]] = [(l, e) for l, row in enumerate(self.live)
                                                for e, live in enumerate(row) if not live]
        self.version += 1

    @property
    def all_served(self) -> bool:
        """Every pair has at least one live holder."""
        return not self.unserved

    def mark_down(self, worker: int) -> bool:
        """Stop sending to `worker`; True when every pair still has a live holder."""
        if worker not in self.down:
            self.down.add(worker)
            self._rebuild()
        return self.all_served

    def mark_up(self, worker: int) -> None:
        if worker in self.down:
            self.down.discard(worker)
            self._rebuild()

    def pairs_of(self, worker: int) -> list[tuple[int, int]]:
        """Every (layer, expert) that `worker` holds in this table."""
        return [(l, e) for l, row in enumerate(self.holders) for e, copies in enumerate(row) if worker in copies]

    def has_choice(self, layer: int) -> bool:
        """Whether some expert of `layer` has two or more live holders (else `base[layer]` decides)."""
        return bool(self.replicated[layer])

    def round_robin_tables(self) -> list[list[list[int]]]:
        """R tables [L][E] of live holders taken in turn (table r: copy r mod copies), for display and tests."""
        num_tables = max((len(live) for row in self.live for live in row), default=1) or 1
        return [[[live[turn % len(live)] if live else base for live, base in zip(lrow, brow)]
                 for lrow, brow in zip(self.live, self.base)] for turn in range(num_tables)]

    # ------------------------------------------------------------------ the choice
    def choose(self, layer: int, expert_token_counts: Sequence[int], in_flight: Sequence[int]) -> list[int]:
        """owner [E] for one dispatch of `layer`. expert_token_counts [E]: expert-slot tokens of
        this dispatch per expert; in_flight [>= W]: expert-slot tokens outstanding per worker."""
        owner = list(self.base[layer])
        replicated = self.replicated[layer]
        if not replicated:
            return owner
        live_row = self.live[layer]
        if self.policy is ReplicaPolicy.ROUND_ROBIN:
            turn = self._turn
            self._turn += 1
            for expert in replicated:
                copies = live_row[expert]
                owner[expert] = copies[turn % len(copies)]
            return owner
        load = list(in_flight) + [0] * max(0, self.num_workers - len(in_flight))
        choice = set(replicated)
        for expert, count in enumerate(expert_token_counts):
            if count and expert not in choice:
                load[owner[expert]] += count
        for expert in sorted(replicated, key=lambda e: (-expert_token_counts[e], e)):
            count = expert_token_counts[expert]
            if not count:
                continue  # no tokens: keep the first live holder (nothing is sent for it)
            best = min(live_row[expert], key=lambda w: (load[w], w))
            owner[expert] = best
            load[best] += count
        return owner
