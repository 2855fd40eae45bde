"""The CSA indexer's scores and top-k in one launch (`indexer_topk.indexer_scores_top_k`) against its two-launch
reference (`indexer_scores`, then `top_k_columns`'s radix-select kernel): equal scores and equal top-k ids (the same
selected columns in the same order), bit for bit.

Cases: 1 to 9 tokens (decode and short verify chunks), tokens that see fewer, as many and more rows than K,
one and several score programs per token (the count the last program waits for is a runtime value), rows read
in one block and in several by the selection, rows with exactly equal scores (ties at the K-th value), own and
paged row stores, plain and FP8 indexer rows, fp32 and bf16.
CPU: the kernels under TRITON_INTERPRET=1 at small sizes (`test_interpreted_*`: run here when this process
interprets, else in one child process that does). CUDA (skipped without a GPU and under the interpreter): the same
at V4-Flash size (64 heads x 128 dims, top-512, up to 64 tokens over 2,048 to 8,192 rows), and the one launch
captured in a CUDA graph and replayed.
Legend: T tokens, H indexer heads, d indexer head dim, N score columns, K top-k.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpret_support import INTERPRETING, cuda, interpreted, patch_interpreter, run_interpreted_tests  # noqa: E402,F401
from moemesh.common.model.config import AttentionKind  # noqa: E402
from moemesh.common.model.kv_storage import KVStorage  # noqa: E402
from moemesh.common.model.random_init import flash_config, tiny_flash_like_config  # noqa: E402
from moemesh.common.model.state import SequenceState  # noqa: E402

KINDS = (AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA)


patch_interpreter()


def test_interpreted_cases_in_a_child():
    run_interpreted_tests(__file__, timeout_s=600)


# ------------------------------------------------------------------------------------------ helpers
def _csa_layer(config) -> int:
    return next(layer for layer, kind in enumerate(config.layer_types) if kind is AttentionKind.CSA)


def _states(config, num_sequences: int, max_tokens: int, storage: KVStorage, row_store: str, dtype,
            device) -> list[SequenceState]:
    """Sequence states with their own row stores, or paged through a pool of scattered (descending) blocks that
    hold `max_tokens` tokens per sequence."""
    if row_store == "own":
        return [SequenceState(config, dtype=dtype, device=device, kv_storage=storage) for _ in range(num_sequences)]
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.kv_pool import BlockTable, KVPool

    block_size = max(32, *(config.compress_ratio(layer) or 1 for layer in range(config.num_hidden_layers)))
    blocks_per_sequence = max_tokens // block_size + 1
    num_blocks = blocks_per_sequence * num_sequences + 8
    pool = KVPool(config, KVPoolConfig(block_size_tokens=block_size, num_primary_blocks=num_blocks,
                                       kv_storage=storage), dtype, device)
    states = []
    for index in range(num_sequences):
        table = BlockTable(torch.device(device))
        table.update([num_blocks - 1 - blocks_per_sequence * index - k for k in range(blocks_per_sequence)])
        states.append(SequenceState(config, dtype=dtype, device=device, kv_storage=storage,
                                    row_store_factory=pool.row_store_factory(table)))
    states[0]._pool_keepalive = pool  # noqa: SLF001 - the pool must outlive the states
    return states


def _batch(config, lengths, new_tokens, storage, row_store, dtype, device, *, ties: bool, seed: int):
    """A forward of `new_tokens[i]` tokens after a random history of `lengths[i]` tokens per sequence, its CSA layer's
    indexer rows written for every row the new tokens see -> (batch, layer). With `ties`, rows repeat (and some
    are zero), so that with non-negative head weights a token's K-th largest score is one of many equal ones."""
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.random_init import fill_random_context

    layer, ratio = _csa_layer(config), config.csa_compress_ratio
    generator = torch.Generator(device=device).manual_seed(seed)
    max_tokens = max(length + new for length, new in zip(lengths, new_tokens))
    states = _states(config, len(lengths), max_tokens, storage, row_store, dtype, device)
    for state, length, new in zip(states, lengths, new_tokens):
        fill_random_context(state, length, generator=generator)
        num_rows = (length + new) // ratio
        rows = torch.randn(num_rows, config.index_head_dim, generator=generator, device=device)  # [R, d]
        if ties:  # two repeated rows, a few distinct ones (index 1 mod 16), zero rows: fewer than K distinct scores
            repeated = torch.randn(2, config.index_head_dim, generator=generator, device=device)
            index = torch.arange(num_rows, device=device)
            rows = torch.where((index % 16 == 1)[:, None], rows, repeated[index % 2])
            rows[::5] = 0.0
        state.layers[layer].indexer.write_rows(0, rows.to(dtype))
    batch = ForwardBatch([SequenceChunk(state, new) for state, new in zip(states, new_tokens)], device,
                         attention_backend=AttentionBackend.TRITON)
    assert (batch.attention_tables.indexer_rows is not None) == (storage is KVStorage.FP8)
    return batch, layer


def check_one_launch_equals_two(config, lengths, new_tokens, topk: int, storage: KVStorage, row_store: str, dtype,
                                device, *, ties: bool = False, block_n: int = 64,
                                blocks_per_program: tuple[int | None, ...] = (None,), seed: int = 0) -> None:
    """indexer_scores_top_k == (indexer_scores, top_k_columns) bit for bit, and `indexer_topk` takes the one launch;
    every pick of a token that sees more than K rows is one of its visible rows."""
    from moemesh.common.kernels import indexer_topk as module

    batch, layer = _batch(config, lengths, new_tokens, storage, row_store, dtype, device, ties=ties, seed=seed)
    tables, ratio = batch.attention_tables, config.csa_compress_ratio
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    num_tokens, heads, dim = batch.num_tokens, config.index_n_heads, config.index_head_dim
    queries = torch.randn(num_tokens, heads, dim, generator=generator, device=device).to(dtype)  # [T, H, d]
    weights = torch.randn(num_tokens, heads, generator=generator, device=device)  # [T, H]
    if ties:  # ReLU zeros: rows whose every head's logit is negative score exactly 0
        weights = weights.abs()
    want_scores = module.indexer_scores(queries, weights, tables, layer, ratio=ratio, block_n=block_n)  # [T, N]
    want_ids = module.top_k_columns(want_scores, topk)  # [T, K]
    visible = ((batch.positions + 1) // ratio).to(device)  # [T]
    assert int(visible.max()) > topk, "no token sees more than K rows: nothing to pick"
    for per_program in blocks_per_program:
        scores, ids = module.indexer_scores_top_k(queries, weights, tables, layer, ratio=ratio, topk=topk,
                                                  block_n=block_n, blocks_per_program=per_program)
        assert torch.equal(scores, want_scores), per_program
        assert torch.equal(ids, want_ids), per_program
    assert torch.equal(module.indexer_topk(queries, weights, tables, layer, ratio=ratio, topk=topk, block_n=block_n),
                       want_ids)
    picking = visible > topk
    assert bool((want_ids[picking] < visible[picking, None]).all()), "a pick past the token's visible rows"
    if ties:
        kth = want_scores[picking].topk(topk, dim=-1).values[:, -1]  # [T'] the K-th largest score
        assert bool(((want_scores[picking] == kth[:, None]).sum(-1) > 1).any()), "no tie at the K-th score"


# ----------------------------------------------------------------------------------------------- CPU
# (history lengths, new tokens per sequence, K): ratio 4, so the tokens see ~length / 4 rows
CASES = {
    "decode_1": ((41,), (1,), 4),
    "decode_3_below_and_above_k": ((9 * 4 + 3, 4 * 4, 13 * 4 - 2), (1, 1, 1), 7),
    "verify_3x2": ((9 * 4 + 3, 4 * 4, 13 * 4 - 2), (2, 2, 2), 4),
    "mixed_9": ((23, 64, 90), (1, 5, 3), 11),
}


@interpreted
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("storage,row_store", [(KVStorage.BF16, "own"), (KVStorage.BF16, "paged"),
                                               (KVStorage.FP8, "own"), (KVStorage.FP8, "paged")],
                         ids=["plain_own", "plain_paged", "fp8_own", "fp8_paged"])
def test_interpreted_one_launch_equals_two_launches(case, storage, row_store):
    lengths, new_tokens, topk = CASES[case]
    check_one_launch_equals_two(tiny_flash_like_config(KINDS), lengths, new_tokens, topk, storage, row_store,
                                torch.bfloat16, "cpu", block_n=4, blocks_per_program=(None, 1, 2, 4))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("storage", [KVStorage.BF16, KVStorage.FP8], ids=["plain", "fp8"])
def test_interpreted_one_launch_equals_two_launches_with_ties(dtype, storage):
    check_one_launch_equals_two(tiny_flash_like_config(KINDS), (9 * 4 + 3, 13 * 4 - 2), (2, 1), 5, storage, "paged",
                                dtype, "cpu", ties=True, block_n=4, blocks_per_program=(None, 2))


@interpreted
def test_interpreted_one_launch_selects_over_several_blocks(monkeypatch):
    from moemesh.common.kernels import indexer_topk

    monkeypatch.setattr(indexer_topk, "TOPK_MAX_BLOCK", 128)  # rows of ~150 scores read in 2 blocks per pass
    check_one_launch_equals_two(tiny_flash_like_config(KINDS), (600, 290), (1, 2), 40, KVStorage.BF16, "own",
                                torch.bfloat16, "cpu", ties=True, block_n=16, blocks_per_program=(None, 4))


def test_one_launch_refuses_what_it_does_not_cover():
    from moemesh.common.kernels.indexer_topk import TOPK_KERNEL_MAX_TOKENS, indexer_scores_top_k

    config = tiny_flash_like_config(KINDS)
    batch, layer = _batch(config, (41,), (1,), KVStorage.BF16, "own", torch.float32, "cpu", ties=False, seed=0)
    queries = torch.zeros(1, config.index_n_heads, config.index_head_dim)
    weights = torch.zeros(1, config.index_n_heads)
    with pytest.raises(ValueError):  # 10 rows visible: no top-11
        indexer_scores_top_k(queries, weights, batch.attention_tables, layer, ratio=4, topk=11)
    many = torch.zeros(TOPK_KERNEL_MAX_TOKENS + 1, config.index_n_heads, config.index_head_dim)
    with pytest.raises(ValueError):
        indexer_scores_top_k(many, weights.expand(many.shape[0], -1), batch.attention_tables, layer, ratio=4, topk=4)


# -------------------------------------------------------------------------------------- CUDA, V4-Flash
@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens,context", [(1, 20000), (8, 8192), (64, 2100)])
@pytest.mark.parametrize("storage", [KVStorage.BF16, KVStorage.FP8], ids=["plain", "fp8"])
def test_cuda_one_launch_equals_two_launches_at_flash_size(num_tokens, context, storage):
    """64 heads x 128 dims, top-512: decode batches of 1 / 8 / 64 sequences (contexts spread below `context`, the
    shortest below 4 x 512 tokens: they see fewer than K rows), paged rows."""
    config = flash_config(KINDS)
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (64, 128, 512)
    lengths = [context - (index * 997) % max(context - 1000, 1) for index in range(num_tokens)]
    if num_tokens > 1:
        lengths[-1] = 1500  # 375 rows: fewer than K
    check_one_launch_equals_two(config, lengths, [1] * num_tokens, config.index_topk, storage, "paged",
                                torch.bfloat16, "cuda", blocks_per_program=(None, 1))
    check_one_launch_equals_two(config, lengths[:2], [1] * min(2, num_tokens), config.index_topk, storage, "own",
                                torch.bfloat16, "cuda", ties=True, seed=3)


@cuda
@pytest.mark.cuda
def test_cuda_one_launch_replays_in_a_cuda_graph():
    """Captured once, replayed: the same scores and ids as the eager launch (no host read, fixed grid)."""
    from moemesh.common.kernels.indexer_topk import indexer_scores_top_k

    config = flash_config(KINDS)
    batch, layer = _batch(config, [6000, 3000, 4500, 2100], [1, 1, 1, 1], KVStorage.FP8, "paged", torch.bfloat16,
                          "cuda", ties=False, seed=5)
    generator = torch.Generator(device="cuda").manual_seed(6)
    queries = torch.randn(4, 64, 128, generator=generator, device="cuda").bfloat16()  # [T, H, d]
    weights = torch.randn(4, 64, generator=generator, device="cuda")  # [T, H]

    def run():
        return indexer_scores_top_k(queries, weights, batch.attention_tables, layer, ratio=4, topk=512)

    eager = run()
    run()  # compiled and the counters allocated before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for want, got in zip(eager, captured):
        assert torch.equal(want, got)
