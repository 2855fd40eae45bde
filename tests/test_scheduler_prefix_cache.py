"""Prefix caching on full blocks: chain hashes, sharing with reference counts, hits, LRU eviction."""

from __future__ import annotations

import random

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.scheduler import Request, RestoreReason, Scheduler, SchedulerConfig
from moemesh.services.router.scheduler.block_pool import BlockPool
from moemesh.services.router.scheduler.prefix_cache import ROOT_PARENT_HASH, extend_block_hashes, hash_block_tokens
from sim_engine_support import SimulatedEngine

BLOCK = 128


def tokens(seed: str, count: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000) for _ in range(count))


def make_engine(num_gpu_blocks: int = 32, max_model_len: int = 2048, **overrides) -> SimulatedEngine:
    config = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, max_model_len=max_model_len, **overrides)
    return SimulatedEngine(Scheduler(config))


def run_one(engine: SimulatedEngine, request_id: str, prompt: tuple[int, ...], max_tokens: int = 2) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.add(request)
    engine.run_until_done(max_steps=100)
    return request


def test_chain_hash_depends_on_everything_before_the_block():
    block_x = tokens("x", BLOCK)
    after_p1 = hash_block_tokens(hash_block_tokens(ROOT_PARENT_HASH, tokens("p1", BLOCK)), block_x)
    after_p2 = hash_block_tokens(hash_block_tokens(ROOT_PARENT_HASH, tokens("p2", BLOCK)), block_x)
    assert after_p1 != after_p2
    assert after_p1 == hash_block_tokens(hash_block_tokens(ROOT_PARENT_HASH, tokens("p1", BLOCK)), block_x)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens("p1", BLOCK) + block_x + (1, 2, 3), 2 * BLOCK + 3, BLOCK)
    assert hashes[1] == after_p1 and len(hashes) == 2  # the partial third block is not hashed


def test_same_block_after_different_prefix_does_not_hit():
    engine = make_engine()
    shared = tokens("x", BLOCK)
    run_one(engine, "first", tokens("p1", BLOCK) + shared + (5,))
    other = run_one(engine, "other_prefix", tokens("p2", BLOCK) + shared + (5,))
    assert other.num_cached_prefix_tokens == 0
    same = run_one(engine, "same_prefix", tokens("p1", BLOCK) + shared + (7, 8))
    assert same.num_cached_prefix_tokens == 2 * BLOCK
    stats = engine.scheduler.stats()
    assert stats.prefix_cache_queries == 3 and stats.prefix_cache_hit_tokens == 2 * BLOCK


def test_concurrent_requests_share_blocks_with_reference_counts():
    engine = make_engine()
    prefix = tokens("shared", 2 * BLOCK)
    engine.add(Request("a", prefix + (1,), SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()  # a computes its prompt; its two full blocks get keys
    engine.add(Request("b", prefix + (2, 3), SamplingParams(max_tokens=50, ignore_eos=True)))
    record = engine.step()
    plan_b = next(seq for seq in record.plan.scheduled if seq.request_id == "b")
    plan_a = next(seq for seq in record.plan.scheduled if seq.request_id == "a")
    assert plan_b.block_ids[:2] == plan_a.block_ids[:2] and plan_b.start_position == 2 * BLOCK
    restore = record.plan.state_restores[0]
    assert restore.reason is RestoreReason.PREFIX_HIT and restore.block_ids == plan_a.block_ids[:2]
    pool = engine.scheduler.kv.gpu
    assert [pool.ref_count(block_id) for block_id in plan_a.block_ids[:2]] == [2, 2]
    engine.scheduler.abort("a")
    assert [pool.ref_count(block_id) for block_id in plan_a.block_ids[:2]] == [1, 1]
    engine.run_until_done(max_steps=100)
    assert [pool.ref_count(block_id) for block_id in plan_a.block_ids[:2]] == [0, 0]
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks >= 2  # freed but still cached
    assert engine.requests["b"].output_token_ids == engine.expected_output(engine.requests["b"], 50)


def test_hit_leaves_at_least_one_token_to_compute():
    engine = make_engine()
    prompt = tokens("exact", 2 * BLOCK)
    run_one(engine, "first", prompt + (1,))
    again = Request("again", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add(again)
    record = engine.step()
    seq = record.plan.scheduled[0]
    assert again.num_cached_prefix_tokens == BLOCK  # not 2 blocks: the last token must be computed
    assert seq.start_position == BLOCK and seq.num_tokens == BLOCK and seq.sample_logits


def test_lru_evicts_least_recently_freed_blocks_first():
    engine = make_engine(num_gpu_blocks=6, max_model_len=768)
    old = tokens("old", 2 * BLOCK) + (1,)
    recent = tokens("recent", 2 * BLOCK) + (1,)
    run_one(engine, "old", old)
    run_one(engine, "recent", recent)
    assert engine.scheduler.kv.gpu.num_cached_blocks == 4
    # Needs 3 blocks: 2 never-keyed free blocks plus the oldest cached one.
    run_one(engine, "filler", tokens("filler", 2 * BLOCK + 10))
    survivors = run_one(engine, "recent_again", recent)
    assert survivors.num_cached_prefix_tokens == 2 * BLOCK
    evicted = run_one(engine, "old_again", old)
    assert evicted.num_cached_prefix_tokens < 2 * BLOCK


def test_block_pool_eviction_order_and_refcounts():
    pool = BlockPool(4, enable_caching=True)
    first = pool.allocate(2)
    assert pool.register(first[0], b"h0") and pool.register(first[1], b"h1")
    assert not pool.register(first[1], b"h-other")  # a block keeps its first key
    pool.free(reversed(first))  # tail first: h1 is evicted before h0
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    pool.allocate(2)  # the never-keyed blocks go first
    assert pool.num_cached_blocks == 2
    pool.allocate(1)
    assert pool.lookup(b"h1") is None and pool.lookup(b"h0") == first[0]
    pool.take_cached(first[0])
    assert pool.ref_count(first[0]) == 1 and pool.num_free_blocks == 0


def test_disabled_prefix_caching_never_hits():
    engine = make_engine(enable_prefix_caching=False)
    prompt = tokens("p", 3 * BLOCK)
    run_one(engine, "one", prompt)
    two = run_one(engine, "two", prompt)
    assert two.num_cached_prefix_tokens == 0 and engine.scheduler.kv.gpu.num_cached_blocks == 0
