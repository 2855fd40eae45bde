"""The batched attention kernels on FP8 main rows (`kv_dtype = "fp8"`) against their torch references.

- `kv_write.write_rings` / `write_rows` quantize in the kernel: the bytes they store are those of
  `kv_rows.pack_main_rows` of the same rows, bit for bit (window rings, a chunk longer than the ring, own and
  paged compressed rows; fp32 and bf16 rows; zero blocks, e4m3 subnormals, ties).
- `sparse_attention` reads FP8 rows (dequantized in registers): whole attention layers on the kernel path match
  the per-sequence torch path on the same FP8 states (which decodes with `unpack_main_rows`), and in fp32 both paths
  store the same window bytes; mixed prefill / decode / verification / rollback, own and paged rows, 1 and 2 scale
  blocks.
- FP8 indexer rows (132 bytes at V4-Flash width): `write_rows` stores the bytes of `kv_rows.pack_indexer_rows`, and
  `indexer_scores` reading them (dequantized in registers) gives the scores and top-k it gives over plain rows
  holding the reference's FP8 quant-dequant of the same rows (`qat.indexer_fp8_qat`): bit for bit under the
  interpreter, up to fp32 summation order on a GPU; and the torch formula's scores on the decoded rows within
  rounding.
- Decode steps over the static tables of a captured step (`graph_tables.StaticDecodeTables`: window closes
  predicated on the device, split sizes from device memory) on recording states of an FP8 pool, advanced by
  `commit_kernel_writes` (block-end snapshots taken from the FP8 rings), match the torch path and its snapshots.
CPU: the kernels under TRITON_INTERPRET=1 at small sizes (`test_interpreted_*`: run here when this process
interprets, else in one child process that does). CUDA (skipped without a GPU and under the interpreter): the same
at V4-Flash width (head dim 512 = 448 + 64: 584-byte rows) in bf16, and the static-table decode step captured in
a CUDA graph and replayed at new positions.
Tolerances: fp32 layers 2e-4 relative (both paths attend the same stored values; the kernels sum in another
order), bf16 3e-2 (the torch path rounds logits and probabilities to bf16; the kernels keep fp32).
Legend: T tokens, D hidden, Ws stored row width.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from interpret_support import INTERPRETING, cuda, interpreted, patch_interpreter, run_interpreted_tests  # noqa: E402,F401
from moemesh.common.model.config import AttentionKind  # noqa: E402
from moemesh.common.model.kv_rows import (  # noqa: E402
    IndexerRowLayout, MainRowLayout, pack_indexer_rows, pack_main_rows, unpack_main_rows,
)
from moemesh.common.model.kv_storage import KVStorage  # noqa: E402
from moemesh.common.model.random_init import flash_config, tiny_flash_like_config  # noqa: E402
from moemesh.common.model.rope import RotaryTables  # noqa: E402
from moemesh.common.model.state import SequenceState  # noqa: E402

KINDS = (AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA)
FP32_TOLERANCE = 2e-4
BF16_TOLERANCE = 3e-2


patch_interpreter()


def test_interpreted_cases_in_a_child():
    run_interpreted_tests(__file__, timeout_s=600)


# ------------------------------------------------------------------------------------------ helpers
def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _hard_rows(num_rows: int, dim: int, nope: int, generator: torch.Generator) -> torch.Tensor:
    """Rows [R, dim] fp32 that reach every branch of the quantizer: very different magnitudes, an all-zero block,
    a block of tiny values next to a large one (e4m3 subnormal codes), values halfway between two codes (ties),
    negative zero, the 448 bound."""
    rows = torch.randn(num_rows, dim, generator=generator)
    rows *= torch.exp(3 * torch.randn(num_rows, 1, generator=generator))
    rows[0, :nope] = 0.0
    rows[1, :nope] *= 1e-5
    rows[1, 0] = 1.0  # amax 1 -> scale 2^-8: the rest are codes far below 2^-6, subnormals
    rows[2, :nope] = torch.arange(nope) * (2.0 ** -8) * 0.5 + 2.0 ** -8 * (17 / 16)  # ties of the finest codes
    rows[2, 0] = 1.75
    rows[3, :nope] = -0.0
    rows[3, 1] = 448.0
    return rows


def _paged_pool(config, num_sequences: int, dtype, device):
    """An FP8 pool with 8 scattered (descending) blocks per sequence -> (pool, block tables)."""
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.kv_pool import BlockTable, KVPool

    block_size = max(32, *(config.compress_ratio(layer) or 1 for layer in range(config.num_hidden_layers)))
    num_blocks = 8 * num_sequences + 8
    pool = KVPool(config, KVPoolConfig(block_size_tokens=block_size, num_primary_blocks=num_blocks,
                                       kv_storage=KVStorage.FP8), dtype, device)
    tables = []
    for index in range(num_sequences):
        table = BlockTable(torch.device(device))
        table.update([num_blocks - 1 - 8 * index - k for k in range(8)])
        tables.append(table)
    return pool, tables


def _fp8_states(config, num_sequences: int, row_store: str, dtype, device) -> list[SequenceState]:
    if row_store == "own":
        return [SequenceState(config, dtype=dtype, device=device, kv_storage=KVStorage.FP8)
                for _ in range(num_sequences)]
    pool, tables = _paged_pool(config, num_sequences, dtype, device)
    states = [SequenceState(config, dtype=dtype, device=device, kv_storage=KVStorage.FP8,
                            row_store_factory=pool.row_store_factory(table)) for table in tables]
    states[0]._pool_keepalive = pool  # noqa: SLF001 - the pool must outlive the states
    return states


# ------------------------------------------------------------------------------------------ write kernels
def check_write_kernels(config, dtype: torch.dtype, device) -> None:
    """One forward's window rows and compressed rows through the write kernels, against pack_main_rows."""
    from moemesh.common.kernels.attention_layout import Field
    from moemesh.common.kernels.kv_write import write_rings, write_rows
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk

    layout = MainRowLayout.of(config)
    generator = torch.Generator().manual_seed(7)
    hca = next(layer for layer, kind in enumerate(config.layer_types) if kind is AttentionKind.HCA)
    ratio = config.compress_ratio(hca)
    for row_store in ("own", "paged"):
        states = _fp8_states(config, 2, row_store, dtype, device)
        ring_size = states[0].layers[0].window.ring_size
        lengths = (ring_size + 5, 2 * ratio + 3)  # a chunk longer than the ring: its last ring_size rows stay
        batch = ForwardBatch([SequenceChunk(state, n) for state, n in zip(states, lengths)], device,
                             attention_backend=AttentionBackend.TRITON)
        tables = batch.attention_tables
        assert tables is not None and tables.main_rows == layout
        rows = _hard_rows(batch.num_tokens, config.head_dim, layout.nope_dim, generator).to(device, dtype)  # [T, hd]
        write_rings(rows, rows, tables, 0, Field.WINDOW_ADDR, Field.WINDOW_RING)
        closing, num_closing = tables.closing_tokens(ratio)
        write_rows(rows[closing], rows.new_empty(0), tables, hca, ratio=ratio, indexer=False)
        for state, sl, length in zip(states, batch.slices, lengths):
            kept = rows[sl][-ring_size:]  # [n, hd], positions length - n ..
            slots = torch.arange(length - kept.shape[0], length, device=device) % ring_size
            want = pack_main_rows(kept, layout)
            assert torch.equal(state.layers[0].window.ring[slots].cpu(), want.cpu()), (row_store, length)
            store = state.layers[hca].compressor
            num_rows = length // ratio
            got = store.own_rows[:num_rows] if store.own_rows is not None else store.row_store.read(num_rows)
            positions = torch.arange(ratio - 1, length, ratio, device=device)  # closing positions of this sequence
            want_rows = pack_main_rows(rows[sl][positions], layout)
            assert torch.equal(got.cpu(), want_rows.cpu()), (row_store, length)
        assert num_closing == sum(n // ratio for n in lengths)


@interpreted
@pytest.mark.parametrize("width", ["24+8", "112+16", "448+64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_write_kernels_store_the_bytes_of_pack_main_rows(width, dtype):
    kinds = (AttentionKind.WINDOW, AttentionKind.HCA)
    if width == "448+64":
        config = flash_config(kinds, sliding_window=16, compress_rate_hca=8)
    else:
        config = tiny_flash_like_config(kinds, kernel_friendly=width == "112+16")
    check_write_kernels(config, dtype, "cpu")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_write_kernels_store_the_bytes_of_pack_main_rows(dtype):
    check_write_kernels(flash_config((AttentionKind.WINDOW, AttentionKind.HCA)), dtype, "cuda")


# ------------------------------------------------------------------------------------------ FP8 indexer rows
def _csa_layer(config) -> int:
    return next(layer for layer, kind in enumerate(config.layer_types) if kind is AttentionKind.CSA)


def check_indexer_write_kernel(config, dtype: torch.dtype, device) -> None:
    """One forward's indexer rows through `write_rows`, against pack_indexer_rows, own and paged rows."""
    from moemesh.common.kernels.kv_write import write_rows
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk

    layout = IndexerRowLayout(config.index_head_dim)
    layer, ratio = _csa_layer(config), config.csa_compress_ratio
    generator = torch.Generator().manual_seed(8)
    for row_store in ("own", "paged"):
        states = _fp8_states(config, 2, row_store, dtype, device)
        lengths = (7 * ratio + 1, 3 * ratio - 1)
        batch = ForwardBatch([SequenceChunk(state, n) for state, n in zip(states, lengths)], device,
                             attention_backend=AttentionBackend.TRITON)
        tables = batch.attention_tables
        assert tables is not None and tables.indexer_rows == layout
        closing, num_closing = tables.closing_tokens(ratio)
        rows = _hard_rows(num_closing, layout.dim, layout.dim, generator).to(device, dtype)  # [Nc, d]
        write_rows(rows, rows.new_empty(0), tables, layer, ratio=ratio, indexer=True)
        first = 0
        for state, length in zip(states, lengths):
            store = state.layers[layer].indexer
            num_rows = length // ratio
            got = store.own_rows[:num_rows] if store.own_rows is not None else store.row_store.read(num_rows)
            assert got.dtype == torch.uint8 and got.shape == (num_rows, layout.row_bytes)
            assert torch.equal(got.cpu(), pack_indexer_rows(rows[first: first + num_rows], layout).cpu()), row_store
            first += num_rows
        assert first == num_closing


def check_indexer_scores_on_fp8_rows(config, dtype: torch.dtype, device, tolerance: float) -> None:
    """Scores of 3 sequences (random histories, 2 new tokens each) over FP8 indexer rows against the same kernel over
    plain rows holding `indexer_fp8_qat` of the same rows (bit for bit and the same top-k under the interpreter; on a
    GPU within fp32 summation order), and against the torch formula on the decoded rows (`Indexer.scores`, within
    `tolerance`)."""
    from moemesh.common.kernels.indexer_topk import indexer_scores, top_k_columns
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.indexer import Indexer
    from moemesh.common.model.qat import indexer_fp8_qat
    from moemesh.common.model.random_init import fill_random_context

    layer, ratio = _csa_layer(config), config.csa_compress_ratio
    lengths = (9 * ratio + 3, 4 * ratio, 13 * ratio - 2)
    fp8_states = _fp8_states(config, 3, "paged", dtype, device)
    plain_states = [SequenceState(config, dtype=dtype, device=device) for _ in lengths]
    generator = torch.Generator(device=device).manual_seed(4)
    for fp8_state, plain_state, length in zip(fp8_states, plain_states, lengths):
        fill_random_context(fp8_state, length, generator=generator)
        fill_random_context(plain_state, length, generator=generator)
        fp8_rows = fp8_state.layers[layer].indexer  # rows the 2 new tokens see (in a run they are emitted first)
        raw = torch.randn((length + 2) // ratio, config.index_head_dim, generator=generator, device=device) * 3
        fp8_rows.write_rows(0, raw.to(dtype))  # packed by the store
        plain_state.layers[layer].indexer.write_rows(0, indexer_fp8_qat(raw.to(dtype)))  # the reference rounding
    heads, dim = config.index_n_heads, config.index_head_dim
    num_tokens = 2 * len(lengths)
    queries = torch.randn(num_tokens, heads, dim, generator=generator, device=device).to(dtype)  # [T, H, d]
    weights = torch.randn(num_tokens, heads, generator=generator, device=device)  # [T, H]
    scores = []
    for states in (fp8_states, plain_states):
        batch = ForwardBatch([SequenceChunk(state, 2) for state in states], device,
                             attention_backend=AttentionBackend.TRITON)
        tables = batch.attention_tables
        assert (tables.indexer_rows is not None) == (states is fp8_states)
        scores.append(indexer_scores(queries, weights, tables, layer, ratio=ratio, block_n=8))
    got, want = scores
    assert got.shape[1] == (max(lengths) + 2) // ratio and bool(torch.isfinite(got).any())
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    if device == "cpu":  # the interpreter: one dot, the same bits and the same picks
        top_k = min(config.index_topk, got.shape[1] // 2)
        assert torch.equal(got, want)
        assert torch.equal(top_k_columns(got, top_k), top_k_columns(want, top_k))
    else:  # compiled, the FP8 and the plain kernel are two programs whose dots may sum in other orders
        finite = torch.isfinite(want)
        assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5 * float(want[finite].abs().max()))
    indexer = Indexer(config, dtype=dtype, device=device)
    for index, state in enumerate(fp8_states):
        sl = slice(2 * index, 2 * index + 2)
        store = state.layers[layer].indexer
        positions = torch.arange(lengths[index], lengths[index] + 2, device=device)
        rows = store.row_format.decode(store.row_store.read((lengths[index] + 2) // ratio))  # [N, d] decoded
        formula = indexer.scores(queries[sl], weights[sl], rows, positions)
        visible = torch.isfinite(formula)
        assert torch.equal(torch.isfinite(got[sl, : formula.shape[1]]), visible)
        assert _relative(got[sl, : formula.shape[1]][visible], formula[visible]) <= tolerance


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_indexer_write_kernel_stores_the_bytes_of_pack_indexer_rows(dtype):
    check_indexer_write_kernel(tiny_flash_like_config(KINDS, kernel_friendly=True), dtype, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_indexer_scores_on_fp8_rows_equal_those_on_the_reference_rounding(dtype):
    check_indexer_scores_on_fp8_rows(tiny_flash_like_config(KINDS), dtype, "cpu",
                                     FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_flash_width_indexer_rows_write_and_score_as_the_reference_rounding(dtype):
    config = flash_config(KINDS)
    assert IndexerRowLayout(config.index_head_dim).row_bytes == 132
    check_indexer_write_kernel(config, dtype, "cuda")
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    check_indexer_scores_on_fp8_rows(config, dtype, "cuda", tolerance)


# ------------------------------------------------------------------------------------------ whole layers
def run_layers(config, steps, num_sequences: int, row_store: str, dtype, device, tolerance: float,
               random_context: tuple[int, ...] = ()) -> None:
    """`steps` (per forward: (sequence, new tokens) pairs, or ("rollback", sequence, tokens)) through window, CSA and
    HCA layers on the torch path and on the kernel path, over two identical sets of FP8 states."""
    from moemesh.bench.checks.attention import random_layers
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.random_init import fill_random_context

    torch.manual_seed(0)
    layers = random_layers(config, dtype, device, seed=1)
    torch_states = _fp8_states(config, num_sequences, row_store, dtype, device)
    kernel_states = _fp8_states(config, num_sequences, row_store, dtype, device)
    for states in (torch_states, kernel_states):
        generator = torch.Generator(device=device).manual_seed(2)
        for state, num_tokens in zip(states, random_context):
            fill_random_context(state, num_tokens, generator=generator)
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for step in steps:
            if step[0] == "rollback":
                torch_states[step[1]].rollback(step[2])
                kernel_states[step[1]].rollback(step[2])
                continue
            x = torch.randn(sum(n for _, n in step), config.hidden_size, generator=generator).to(device, dtype)  # [T, D]
            outputs = []
            for states, backend in ((torch_states, AttentionBackend.TORCH), (kernel_states, AttentionBackend.TRITON)):
                batch = ForwardBatch([SequenceChunk(states[i], n) for i, n in step], device, attention_backend=backend)
                if backend is AttentionBackend.TRITON:
                    assert batch.attention_tables is not None and batch.attention_tables.main_rows is not None
                outputs.append([layer(x, batch) for layer in layers])
                batch.finish()
            for want, got in zip(*outputs):
                assert bool(torch.isfinite(got).all())
                assert _relative(got, want) <= tolerance, (step, _relative(got, want))
            for want_state, got_state in zip(torch_states, kernel_states):
                want_live, got_live = want_state.live_tensors(), got_state.live_tensors()
                for name, tensor in want_live.items():
                    if tensor.numel():
                        assert _relative(got_live[name], tensor) <= tolerance, (step, name)
                if tolerance == FP32_TOLERANCE:  # the same window bytes (bf16: the paths' kv rows may differ by a unit)
                    for want_layer, got_layer in zip(want_state.layers, got_state.layers):
                        assert torch.equal(got_layer.window.ring, want_layer.window.ring), step


MIXED_STEPS = (((0, 21), (1, 5), (2, 13)), ((0, 1), (1, 1), (2, 3)), ("rollback", 0, 1), ("rollback", 2, 2),
               ((0, 2), (1, 1), (2, 3)))
PAGED_STEPS = (((0, 35), (1, 17)), ((0, 1), (1, 3)), ((0, 1), (1, 1)))


@interpreted
def test_interpreted_layers_on_fp8_rows_match_the_torch_path_two_scale_blocks():
    """head_dim 128 = 112 + 16: two scale blocks (the second one partial) in the 64-bit scale word."""
    run_layers(tiny_flash_like_config(KINDS, kernel_friendly=True), MIXED_STEPS, 3, "own", torch.float32, "cpu",
               FP32_TOLERANCE)


@interpreted
def test_interpreted_layers_on_fp8_rows_in_the_paged_pool_match_the_torch_path():
    run_layers(tiny_flash_like_config(KINDS), PAGED_STEPS, 2, "paged", torch.float32, "cpu", FP32_TOLERANCE)


@cuda
@pytest.mark.parametrize("row_store", ["own", "paged"])
def test_cuda_flash_width_layers_on_fp8_rows_match_the_torch_path(row_store):
    steps = (((0, 700), (1, 260)), ((0, 1), (1, 1)), ((0, 3), (1, 3)), ("rollback", 0, 2), ((0, 1), (1, 1)))
    run_layers(flash_config(KINDS), steps, 2, row_store, torch.bfloat16, "cuda", BF16_TOLERANCE)


@cuda
def test_cuda_flash_width_decode_over_long_fp8_histories_matches_the_torch_path():
    """CSA top-k picks among up to 750 rows of random FP8 history, 8 sequences, decode and verification."""
    steps = tuple(tuple((i, 1) for i in range(8)) for _ in range(3)) + (tuple((i, 3) for i in range(8)),)
    run_layers(flash_config(KINDS), steps, 8, "own", torch.bfloat16, "cuda", BF16_TOLERANCE,
               random_context=(300, 3000, 1023, 1024, 517, 129, 2500, 640))


# ------------------------------------------------------------------------------------------ static decode tables
def run_static_decode(config, dtype, device, tolerance: float, *, capture: bool, block_size: int,
                      prompts: tuple[int, ...], num_decode_steps: int, bucket: int) -> None:
    """Sequences prefilled on both paths (kernel side: per-forward tables), then decode steps: the torch path on
    recording states of one FP8 pool, the kernels over `StaticDecodeTables` (padded to `bucket` rows, a CUDA graph
    when `capture`) on recording states of another, advanced by `commit_kernel_writes`. Outputs, states and the
    block-end snapshots (torch: taken while appending; kernels: from the FP8 rings) must agree."""
    from moemesh.bench.checks.attention import random_layers
    from moemesh.common.model.attention_tables import sequence_addresses
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.services.attention.graph_decode import GraphBatch
    from moemesh.services.attention.graph_tables import StaticDecodeTables, index_rows_class
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.kv_pool import KVPool
    from moemesh.services.attention.slots import SlotTable

    torch.manual_seed(0)
    layers = random_layers(config, dtype, device, seed=1)
    pools, slot_tables = [], []
    num_blocks_each = -(-(max(prompts) + num_decode_steps) // block_size)
    for _ in range(2):
        pools.append(KVPool(config, KVPoolConfig(block_size, num_blocks_each * len(prompts) + 1,
                                                 kv_storage=KVStorage.FP8), dtype, device))
        slot_tables.append(SlotTable(config, pools[-1], dtype, torch.device(device)))
    states = [[], []]  # [torch path, kernel path]
    for index, length in enumerate(prompts):
        blocks = tuple(range(index * num_blocks_each, (index + 1) * num_blocks_each))
        for side in (0, 1):
            targets = tuple(enumerate(blocks))  # every block end records, into the snapshot of the block's id
            states[side].append(slot_tables[side].prepare(index, f"r{index}", 0, blocks, {}, targets).state)
    generator = torch.Generator().manual_seed(3)
    layout = MainRowLayout.of(config)
    scratch = SequenceState(config, dtype=dtype, device=device, kv_storage=KVStorage.FP8)
    with torch.inference_mode():
        x = torch.randn(sum(prompts), config.hidden_size, generator=generator).to(device, dtype)
        for side, backend in ((0, AttentionBackend.TORCH), (1, AttentionBackend.TRITON)):
            batch = ForwardBatch([SequenceChunk(s, n) for s, n in zip(states[side], prompts)], device,
                                 attention_backend=backend)
            for layer in layers:
                layer(x, batch)
            batch.finish()
        addresses = sequence_addresses(states[1][0])
        max_rows = (max(prompts) + num_decode_steps) // config.csa_compress_ratio
        tables = StaticDecodeTables(config, bucket, dict(addresses.rows_per_block), num_blocks_each,
                                    index_rows_class(max_rows, config.index_topk), dtype, torch.device(device),
                                    min_real_tokens=len(prompts), main_rows=layout,
                                    indexer_rows=IndexerRowLayout(config.index_head_dim))
        graph_batch = GraphBatch(tables)
        x_static = torch.zeros(bucket, config.hidden_size, dtype=dtype, device=device)  # [Tb, D]
        outputs: list[torch.Tensor] = []
        rotary = RotaryTables.of([layer.rope for layer in layers])

        def step() -> None:
            graph_batch.set_rope(rotary.cos_sin(graph_batch.positions))  # the step's angles, as the embedding sets them
            outputs[:] = [layer(x_static, graph_batch) for layer in layers]

        tables.fill([], None, scratch)  # warm-up over padding rows only (compiles outside a capture)
        step()
        replay = step
        if capture:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            replay = graph.replay
        for _ in range(num_decode_steps):
            x = torch.randn(len(prompts), config.hidden_size, generator=generator).to(device, dtype)  # [T, D]
            batch = ForwardBatch([SequenceChunk(s, 1) for s in states[0]], device,
                                 attention_backend=AttentionBackend.TORCH)
            want = [layer(x, batch) for layer in layers]
            batch.finish()
            tables.fill(states[1], None, scratch)
            x_static[: len(prompts)].copy_(x)
            replay()
            for state in states[1]:
                state.commit_kernel_writes(1)
            for want_out, got_out in zip(want, outputs):
                assert _relative(got_out[: len(prompts)], want_out) <= tolerance
        for want_state, got_state in zip(*states):
            want_live, got_live = want_state.live_tensors(), got_state.live_tensors()
            for name, tensor in want_live.items():
                if tensor.numel():
                    assert _relative(got_live[name], tensor) <= tolerance, name
            if tolerance == FP32_TOLERANCE:
                for want_layer, got_layer in zip(want_state.layers, got_state.layers):
                    assert torch.equal(got_layer.window.ring, want_layer.window.ring)
    for layer in range(config.num_hidden_layers):  # block-end snapshots: from the rings, what the torch path took
        key = (layer, "window_snapshot")
        got, want = (unpack_main_rows(pool.snapshot_primary[key], layout) for pool in (pools[1], pools[0]))
        assert _relative(got, want) <= tolerance, key
        if tolerance == FP32_TOLERANCE:
            assert torch.equal(pools[1].snapshot_primary[key], pools[0].snapshot_primary[key]), key
    assert bool(unpack_main_rows(pools[1].snapshot_primary[(0, "window_snapshot")][0], layout).abs().sum() > 0)


@interpreted
def test_interpreted_static_decode_tables_on_fp8_recording_states():
    """Window 8, ratios 4 and 8, 16-token blocks: decode from positions 13 and 6 crosses the block end at 16 (and
    the HCA close at 15) on the kernel side inside `commit_kernel_writes`, the indexer picking 2 of up to 4 rows;
    two padding rows (bucket 4)."""
    config = tiny_flash_like_config(KINDS, sliding_window=8, compress_rate_hca=8, index_topk=2)
    run_static_decode(config, torch.float32, "cpu", FP32_TOLERANCE, capture=False, block_size=16, prompts=(13, 6),
                      num_decode_steps=5, bucket=4)


@cuda
def test_cuda_flash_width_fp8_decode_step_replays_as_a_cuda_graph():
    run_static_decode(flash_config(KINDS), torch.bfloat16, "cuda", BF16_TOLERANCE, capture=True, block_size=128,
                      prompts=(125, 300, 7), num_decode_steps=6, bucket=4)


# ------------------------------------------------------------------------------------------ sm_90 machine code
@pytest.mark.skipif(INTERPRETING, reason="compiles for sm_90 (no interpreter)")
@pytest.mark.parametrize("prefill", [False, True], ids=["decode_tile", "prefill_tile"])
@pytest.mark.parametrize("use_topk", [True, False], ids=["csa", "hca"])
def test_fp8_attention_tiles_compile_for_sm90_without_spills(prefill, use_topk):
    """V4-Flash width, Triton's bundled ptxas (no GPU needed): the default FP8 tiles keep everything in registers."""
    from moemesh.bench.attention_sass import compile_sparse
    from moemesh.bench.kernel_sass import _tool, summarise
    from moemesh.common.kernels.sparse_attention_plan import default_config

    if not os.path.exists(_tool("ptxas")):
        pytest.skip("triton without its bundled ptxas")
    config = default_config(1024 if prefill else 8, fp8_rows=True)
    summary = summarise(compile_sparse(block_h=config.block_h, block_n=config.block_n, num_warps=config.num_warps,
                                       num_stages=config.num_stages, use_topk=use_topk, fp8_rows=True))
    assert summary["stack_bytes"] == 0, summary
    assert summary["opcodes"].get("HMMA", 0) + summary["opcodes"].get("HGMMA", 0) > 0, "no tensor-core dot"


@pytest.mark.skipif(INTERPRETING, reason="compiles for sm_90 (no interpreter)")
@pytest.mark.parametrize("fp8_rows", [False, True], ids=["bf16_rows", "fp8_rows"])
def test_indexer_scores_compile_for_sm90_without_spills(fp8_rows):
    from moemesh.bench.attention_sass import compile_indexer
    from moemesh.bench.kernel_sass import _tool, summarise

    if not os.path.exists(_tool("ptxas")):
        pytest.skip("triton without its bundled ptxas")
    summary = summarise(compile_indexer(fp8_rows=fp8_rows))
    assert summary["stack_bytes"] == 0, summary
    assert summary["opcodes"].get("HMMA", 0) + summary["opcodes"].get("HGMMA", 0) > 0, "no tensor-core dot"


@pytest.mark.skipif(INTERPRETING, reason="compiles for sm_90 (no interpreter)")
@pytest.mark.parametrize("ring", [True, False], ids=["ring", "rows"])
def test_fp8_row_writers_compile_for_sm90_without_spills(ring):
    from moemesh.bench.attention_sass import compile_fp8_row_writes
    from moemesh.bench.kernel_sass import _tool, summarise

    if not os.path.exists(_tool("ptxas")):
        pytest.skip("triton without its bundled ptxas")
    assert summarise(compile_fp8_row_writes(ring=ring, predicated=not ring))["stack_bytes"] == 0
