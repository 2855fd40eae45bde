"""ReplicaRouter: which copy of a replicated expert gets a dispatch's tokens, and routing around
workers marked down (pure Python, no processes)."""

from __future__ import annotations

import pytest

from moemesh.services.attention.replica_routing import ReplicaPolicy, ReplicaRouter

# one layer, four experts: 0 only on worker 0, 1 only on worker 1, 2 and 3 on both (primary first)
HOLDERS = [[(0,), (1,), (0, 1), (1, 0)]]


def test_least_loaded_gives_each_replicated_expert_to_the_worker_with_less_work():
    router = ReplicaRouter(HOLDERS, ReplicaPolicy.LEAST_LOADED)
    # expert 0 puts 10 tokens on worker 0, expert 1 puts 2 on worker 1: both replicated experts go to 1 ...
    assert router.choose(0, [10, 2, 3, 4], [0, 0]) == [0, 1, 1, 1]
    # ... unless worker 1 already has work in flight (another micro-batch): then the bigger one (4) goes to 0
    assert router.choose(0, [10, 2, 3, 4], [0, 20]) == [0, 1, 0, 0]
    # most tokens first, each to the least loaded: 6 -> worker 0 (tie, lower index), 5 -> worker 1
    assert router.choose(0, [0, 0, 5, 6], [0, 0]) == [0, 1, 1, 0]


def test_least_loaded_keeps_single_copies_and_skips_idle_experts():
    router = ReplicaRouter(HOLDERS)
    owner = router.choose(0, [0, 0, 0, 0], [7, 0])
    assert owner == [0, 1, 0, 1]  # nothing to balance: every expert at its first live holder
    assert router.has_choice(0) and not ReplicaRouter([[(0,), (1,)]]).has_choice(0)


def test_round_robin_takes_the_copies_in_turn():
    router = ReplicaRouter(HOLDERS, ReplicaPolicy.ROUND_ROBIN)
    first = router.choose(0, [1, 1, 1, 1], [0, 0])
    second = router.choose(0, [1, 1, 1, 1], [0, 0])
    assert first == [0, 1, 0, 1] and second == [0, 1, 1, 0]
    assert router.round_robin_tables() == [[[0, 1, 0, 1]], [[0, 1, 1, 0]]]


def test_mark_down_routes_to_replicas_and_reports_unserved_pairs():
    router = ReplicaRouter(HOLDERS)
    assert router.mark_down(1) is False  # expert 1 lives only on worker 1
    assert router.unserved == [(0, 1)]
    assert router.choose(0, [1, 1, 1, 1], [0, 0]) == [0, 1, 0, 0]  # replicated experts only on worker 0 now
    router.mark_up(1)
    assert router.all_served and router.down == set()
    both = ReplicaRouter([[(0, 1), (1, 0)]])
    assert both.mark_down(0) is True and both.choose(0, [3, 3], [0, 0]) == [1, 1]
    assert both.pairs_of(0) == [(0, 0), (0, 1)]


def test_holders_from_owner_tables_and_validation():
    router = ReplicaRouter.from_owner_tables([[[0, 0, 1]], [[1, 0, 1]]])
    assert router.holders == [[(0, 1), (0,), (1,)]]
    with pytest.raises(ValueError, match="no holder"):
        ReplicaRouter([[(0,), ()]])
