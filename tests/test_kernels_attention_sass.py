"""The batched attention kernels compile for sm_90 at V4-Flash sizes on a machine without a GPU
(Triton ships ptxas): compile errors and register spills show up before a device run."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from moemesh.bench.kernel_sass import _tool, summarise  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists(_tool("ptxas")), reason="triton without its bundled ptxas")


@pytest.mark.parametrize("split", [False, True], ids=["one_split", "splits_merged_in_launch"])
def test_default_sparse_attention_tile_compiles_without_spills(split):
    from moemesh.bench.attention_sass import compile_sparse
    from moemesh.common.kernels.sparse_attention_plan import SparseAttentionConfig

    default = SparseAttentionConfig()
    summary = summarise(compile_sparse(block_h=default.block_h, block_n=default.block_n,
                                       num_warps=default.num_warps, num_stages=default.num_stages, split=split))
    assert summary["stack_bytes"] == 0, summary
    assert summary["opcodes"].get("HMMA", 0) + summary["opcodes"].get("HGMMA", 0) > 0, "no tensor-core dot"


@pytest.mark.parametrize("kernel", ["indexer", "pool_csa", "pool_hca", "compressor_step_csa", "compressor_step_hca",
                                    "compressor_step_csa_fp8"])
def test_side_kernels_compile_without_spills(kernel):
    from moemesh.bench.attention_sass import compile_compressor_step, compile_indexer, compile_pool

    compiled = {"indexer": compile_indexer, "pool_csa": lambda: compile_pool(overlap=True),
                "pool_hca": lambda: compile_pool(overlap=False),
                "compressor_step_csa": lambda: compile_compressor_step(csa=True),
                "compressor_step_hca": lambda: compile_compressor_step(csa=False),
                "compressor_step_csa_fp8": lambda: compile_compressor_step(csa=True, fp8_rows=True)}[kernel]()
    summary = summarise(compiled)
    # the compressor step's in-launch RoPE angles: libdevice cosf / sinf keep a 32-byte array for the reduction of
    # huge arguments (any kernel calling them has it), not spilled registers
    assert summary["stack_bytes"] == (32 if kernel.startswith("compressor_step") else 0), summary
    assert summary["num_instructions"] > 100


@pytest.mark.parametrize("num_rows,fp8_rows", [(2048, False), (4096, True), (16384, False)],
                         ids=["2048_rows_one_block", "4096_rows_fp8", "16384_rows_in_blocks"])
def test_indexer_scores_topk_compiles_without_spills(num_rows, fp8_rows):
    """The one-launch indexer scores + top-k at V4-Flash width: the scores' dot on Hopper wgmma, no spills with
    the selection's widest row in registers."""
    from moemesh.bench.attention_sass import compile_indexer_scores_topk

    compiled = compile_indexer_scores_topk(num_rows=num_rows, fp8_rows=fp8_rows)
    summary = summarise(compiled)
    assert summary["stack_bytes"] == 0, summary
    assert "wgmma.mma_async" in compiled.asm["ptx"], "no Hopper wgmma in the scores' dot"
