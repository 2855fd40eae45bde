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
    run_one(engine, "first", prompt)
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


def test_a_hit_resumes_at_a_kept_snapshot_and_a_divergence_point_is_kept_for_the_next():
    """Blocks alone do not resume a sequence: a hit ends at the deepest cached block whose end has a cached resume
    snapshot. A shared system prompt that ends inside a block is found by the second request with it (its cached
    blocks match deeper than any snapshot) and kept there, so the third resumes at the shared blocks."""
    engine = make_engine()
    system = tokens("system", 3 * BLOCK + 40)
    first = run_one(engine, "first", system + tokens("x", 200))
    second = run_one(engine, "second", system + tokens("y", 200))
    third = run_one(engine, "third", system + tokens("z", 200))
    assert first.num_cached_prefix_tokens == 0
    assert second.num_cached_prefix_tokens == 0  # blocks 0..2 cached, no snapshot at 128, 256 or 384
    assert third.num_cached_prefix_tokens == 3 * BLOCK
    assert engine.requests["third"].output_token_ids == engine.expected_output(third, 2)


def test_snapshots_every_interval_let_a_long_shared_prefix_resume_mid_prompt():
    engine = make_engine(snapshot_interval_blocks=2)
    document = tokens("document", 5 * BLOCK + 7)
    run_one(engine, "first", document + tokens("q1", 200))  # kept: 256, 512 (every 2 blocks) and 768 (prompt)
    second = run_one(engine, "second", document + tokens("q2", 200))
    assert second.num_cached_prefix_tokens == 4 * BLOCK  # 5 blocks match; the deepest snapshot among them: 512


def test_a_step_records_the_snapshots_it_needs_and_none_leak():
    """A prefill chunk names its last block end (where the request resumes after a preemption) and the kept ones;
    after every request is done, no snapshot is held: the cached ones are evictable, the rest free."""
    engine = make_engine(long_prefill_token_threshold=4 * BLOCK, snapshot_interval_blocks=16)
    prompt = tokens("p", 9 * BLOCK + 50)
    engine.add(Request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    record = engine.step()
    [seq] = record.plan.scheduled
    assert [index for index, _ in seq.snapshot_targets] == [3]  # positions 0..511: the block end at 512 only
    record = engine.step()
    assert [index for index, _ in record.plan.scheduled[0].snapshot_targets] == [7]
    record = engine.step()  # the prompt's rest, 1024 .. 1202: its last block end 1152 is kept for the cache too
    assert [index for index, _ in record.plan.scheduled[0].snapshot_targets] == [8]
    engine.run_until_done(max_steps=100)
    pool = engine.scheduler.kv.snapshots.gpu
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks >= 1
    assert not engine.scheduler.kv.holds_anything("a")


def test_without_free_snapshots_a_hit_finds_nothing_and_requests_still_run():
    engine = make_engine(num_gpu_snapshots=0)
    prompt = tokens("p", 2 * BLOCK + 10)
    run_one(engine, "first", prompt)
    again = run_one(engine, "again", prompt)
    assert again.num_cached_prefix_tokens == 0
    assert engine.requests["again"].output_token_ids == engine.expected_output(again, 2)


def test_the_rest_of_a_prefix_hit_goes_in_graph_sized_chunks():
    """With the attention worker's graphs (chunks of 8) a hit that leaves at most graph_prefill_token_threshold tokens
    computes them 8 a step from admission on; the same prompt without a hit computes its usual chunk."""
    engine = make_engine(graph_chunk_tokens=8, graph_step_tokens=64, graph_prefill_token_threshold=32)
    prompt = tokens("doc", 2 * BLOCK)
    first = run_one(engine, "first", prompt + tokens("q1", 20))
    assert first.num_cached_prefix_tokens == 0
    engine.add(Request("second", prompt + tokens("q2", 20), SamplingParams(max_tokens=2, ignore_eos=True)))
    plan = engine.step().plan
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("second", 8)]
    assert engine.requests["second"].num_cached_prefix_tokens == 2 * BLOCK
    engine.run_until_done(max_steps=100)
    assert engine.requests["second"].output_token_ids == engine.expected_output(engine.requests["second"], 2)
