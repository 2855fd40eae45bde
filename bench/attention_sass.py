"""Compile the batched attention kernels for sm_90 without a GPU and summarise their machine code.

Usage: python -m moemesh.bench.attention_sass [--kernel sparse|sparse-fp8|fp8-writes|indexer|pool|compressor-step|all]

Triton ships ptxas, so the V4-Flash specialisations (head_dim 512, 64 heads, CSA top-k / HCA)
go through the whole Triton + ptxas pipeline here: a compile error, register spills (stack bytes)
or a main loop without Hopper wgmma show up before a device run. Counts are static.
"""

from __future__ import annotations

import argparse
import json
import sys

from moemesh.common.kernels.attention_layout import NUM_FIELDS, Field


def _compile(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    for name in constexprs:
        signature[name] = "constexpr"
    aligned = [i for i, name in enumerate(kernel.arg_names) if name.endswith("_ptr")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                       "num_stages": num_stages})


def compile_sparse(*, block_h: int, block_n: int, num_warps: int, num_stages: int = 2, use_topk: bool = True,
                   split: bool = False, head_dim: int = 512, paged: bool = False, fp8_rows: bool = False,
                   rotate_back: bool = True, write_ring: bool = True):
    """fp8_rows: window and compressed rows in the 584-byte FP8 layout (448 e4m3 + 64 bf16 channels);
    rotate_back: the output's 64 rotary channels rotated back in the launch (as the model calls it);
    write_ring: the window rings written by the last program of each sequence (decode sizes)."""
    from moemesh.common.kernels.sparse_attention import _sparse_attention_kernel

    signature = {"q_ptr": "*bf16", "new_kv_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
                 "part_ml_ptr": "*fp32", "counter_ptr": "*i32", "sink_ptr": "*fp32", "topk_ptr": "*i32", "cos_ptr": "*fp32",
                 "sin_ptr": "*fp32", "token_seq_ptr": "*i32",
                 "positions_ptr": "*i64", "seq_info_ptr": "*i64", "fields_ptr": "*i64", "block_ids_ptr": "*i64",
                 "scale": "fp32", "num_heads": "i32", "topk_stride": "i32", "block_stride": "i32",
                 "rows_per_block": "i32", "keys_per_split": "i32", "num_splits": "i32"}
    constexprs = {"WINDOW": 128, "RATIO": 4 if use_topk else 128, "USE_TOPK": use_topk, "NUM_FIELDS_": NUM_FIELDS,
                  "F_WIN_ADDR": int(Field.WINDOW_ADDR), "F_WIN_RING": int(Field.WINDOW_RING),
                  "F_ROWS_ADDR": int(Field.ROWS_ADDR), "HEAD_DIM": head_dim,
                  "ROW_BYTES": 584 if fp8_rows else 2 * head_dim, "ROW_ALIGN": 8 if fp8_rows else 16,
                  "BLOCK_H": block_h, "BLOCK_N": block_n, "SPLIT": split, "IEEE": False, "PAGED": paged,
                  "FP8": fp8_rows, "NOPE": head_dim - 64 if fp8_rows else 0, "SCALE_BLOCK": 64 if fp8_rows else 1,
                  "SCALE_OFFSET": head_dim - 64 + 128 if fp8_rows else 0, "ROPE_HALF": 32 if rotate_back else 0,
                  "WRITE_RING": write_ring, "NUM_SCALE_BLOCKS": (head_dim - 64) // 64 if fp8_rows else 1,
                  "SCALE_BLOCKS_P2": 8 if fp8_rows else 1, "ROPE_P2": 64 if fp8_rows else 1}
    return _compile(_sparse_attention_kernel, signature, constexprs, num_warps, num_stages)


def compile_indexer(*, block_n: int = 64, num_warps: int = 4, fp8_rows: bool = False):
    """The indexer scores kernel at V4-Flash width (128-channel rows: bf16, or 132-byte FP8 rows)."""
    from moemesh.common.kernels.indexer_topk import _indexer_scores_kernel

    signature = {"q_ptr": "*bf16", "weights_ptr": "*fp32", "scores_ptr": "*fp32", "token_seq_ptr": "*i32",
                 "positions_ptr": "*i64", "fields_ptr": "*i64", "block_ids_ptr": "*i64", "num_heads": "i32",
                 "num_rows_out": "i32", "block_stride": "i32", "rows_per_block": "i32", "row_scale": "fp32"}
    constexprs = {"RATIO": 4, "NUM_FIELDS_": NUM_FIELDS, "F_ROWS_ADDR": int(Field.INDEX_ROWS_ADDR), "HEAD_DIM": 128,
                  "ROW_BYTES": 132 if fp8_rows else 256, "ROW_ALIGN": 4 if fp8_rows else 16, "BLOCK_HEADS": 64,
                  "BLOCK_N": block_n, "BLOCKS_PER_PROGRAM": 8, "IEEE": False, "PAGED": False, "FP8": fp8_rows}
    return _compile(_indexer_scores_kernel, signature, constexprs, num_warps, 2)


def compile_indexer_scores_topk(*, num_rows: int = 2048, num_warps: int = 4, fp8_rows: bool = False):
    """The one-launch indexer scores + top-k at V4-Flash width (128-channel rows: bf16, or 132-byte FP8 rows, paged)
    over `num_rows` score columns (index_rows_class: 2048 at least; past TOPK_MAX_BLOCK the select reads the row
    in blocks)."""
    from moemesh.common.kernels.indexer_topk import (
        _NUM_DIGITS, _RADIX_BITS, TOPK_MAX_BLOCK, _indexer_scores_topk_kernel,
    )

    signature = {"q_ptr": "*bf16", "weights_ptr": "*fp32", "scores_ptr": "*fp32", "token_seq_ptr": "*i32",
                 "positions_ptr": "*i64", "fields_ptr": "*i64", "block_ids_ptr": "*i64", "num_heads": "i32",
                 "num_rows_out": "i32", "block_stride": "i32", "rows_per_block": "i32", "row_scale": "fp32",
                 "topk_ptr": "*i64", "counter_ptr": "*i32", "k": "i32"}
    block = min(TOPK_MAX_BLOCK, num_rows)
    constexprs = {"RATIO": 4, "NUM_FIELDS_": NUM_FIELDS, "F_ROWS_ADDR": int(Field.INDEX_ROWS_ADDR), "HEAD_DIM": 128,
                  "ROW_BYTES": 132 if fp8_rows else 256, "ROW_ALIGN": 4 if fp8_rows else 16, "BLOCK_HEADS": 64,
                  "BLOCK_N": 64, "BLOCKS_PER_PROGRAM": 1, "IEEE": False, "PAGED": True, "FP8": fp8_rows,
                  "ONE_BLOCK": num_rows <= block, "BLOCK": block, "RADIX_BITS": _RADIX_BITS, "NUM_DIGITS": _NUM_DIGITS}
    return _compile(_indexer_scores_topk_kernel, signature, constexprs, num_warps, 2)


def compile_fp8_row_writes(*, ring: bool, src: str = "*bf16", predicated: bool = False):
    """The FP8 main-row writers at V4-Flash width (448 + 64 channels, 584-byte rows): window ring or compressed rows."""
    from moemesh.common.kernels.kv_write import _write_fp8_ring_kernel, _write_fp8_rows_kernel

    layout = dict(NOPE=448, ROPE=64, BLOCK=64, NUM_BLOCKS=7, BLOCKS_P2=8, ROPE_P2=64, SCALE_OFFSET=576, ROW_BYTES=584)
    if ring:
        signature = {"src_ptr": src, "token_seq_ptr": "*i32", "positions_ptr": "*i64", "seq_info_ptr": "*i64",
                     "fields_ptr": "*i64"}
        constexprs = {"NUM_FIELDS_": NUM_FIELDS, "F_ADDR": int(Field.WINDOW_ADDR), "F_RING": int(Field.WINDOW_RING),
                      **layout}
        return _compile(_write_fp8_ring_kernel, signature, constexprs, 4, 1)
    signature = {"rows_ptr": src, "closing_ptr": "*i64", "token_seq_ptr": "*i32", "positions_ptr": "*i64",
                 "fields_ptr": "*i64", "block_ids_ptr": "*i64", "block_stride": "i32", "rows_per_block": "i64"}
    constexprs = {"RATIO": 4, "NUM_FIELDS_": NUM_FIELDS, "F_ROWS": int(Field.ROWS_ADDR), "PREDICATED": predicated,
                  **layout}
    return _compile(_write_fp8_rows_kernel, signature, constexprs, 4, 1)


def compile_pool(*, overlap: bool = True):
    from moemesh.common.kernels.kv_write import _pool_windows_kernel

    signature = {"kv_ptr": "*bf16", "score_ptr": "*bf16", "out_ptr": "*fp32",
                 "closing_ptr": "*i64", "token_seq_ptr": "*i32", "positions_ptr": "*i64", "seq_info_ptr": "*i64",
                 "fields_ptr": "*i64", "row_dim": "i32"}
    ratio = 4 if overlap else 128
    constexprs = {"RATIO": ratio, "OVERLAP": overlap, "NUM_SLOTS": 2 * ratio if overlap else ratio,
                  "NUM_FIELDS_": NUM_FIELDS, "F_KV": int(Field.INPUT_KV_ADDR), "F_SCORE": int(Field.INPUT_SCORE_ADDR),
                  "F_RING": int(Field.INPUT_RING), "BLOCK_D": 256 if overlap else 16}
    return _compile(_pool_windows_kernel, signature, constexprs, 4, 1)


def compile_compressor_step(*, csa: bool = True, fp8_rows: bool = False):
    """The one-launch compressor step at V4-Flash width: CSA (ratio 4, overlapping, with the indexer's compressor)
    or HCA (ratio 128), bf16 or FP8 rows (main and indexer)."""
    from moemesh.common.kernels.compressor_step import _compressor_step_kernel, pooling_block

    ratio, overlap = (4, True) if csa else (128, False)
    signature = {}
    constexprs = {"RATIO": ratio, "OVERLAP": overlap, "NUM_FIELDS_": NUM_FIELDS, "BLOCK_H": 32,
                  "ROW_FORMAT0": 1 if fp8_rows else 0, "ROW_FORMAT1": 2 if fp8_rows and csa else 0}
    for index, (row_dim, indexer) in enumerate(((512, False), (128 if csa else 512, csa))):
        signature.update({f"kv{index}_ptr": "*bf16", f"score{index}_ptr": "*fp32", f"weight{index}_ptr": "*fp32",
                          f"pooled{index}_ptr": "*fp32", f"normed{index}_ptr": "*bf16",
                          f"rows{index}_like_ptr": "*bf16", f"rows_per_block{index}": "i64", f"eps{index}": "fp32"})
        num_slots, block_d = pooling_block(ratio, overlap, row_dim)
        fields = (Field.INDEX_INPUT_KV_ADDR, Field.INDEX_INPUT_SCORE_ADDR, Field.INDEX_INPUT_RING,
                  Field.INDEX_ROWS_ADDR) if indexer else (Field.INPUT_KV_ADDR, Field.INPUT_SCORE_ADDR,
                                                          Field.INPUT_RING, Field.ROWS_ADDR)
        constexprs.update({f"ROW_DIM{index}": row_dim, f"BLOCK_D{index}": block_d,
                           f"BLOCKS{index}": row_dim // block_d if index == 0 or csa else 0,
                           f"BLOCK_C{index}": row_dim, f"STORE_ROW_BYTES{index}": (
                               (584 if index == 0 else 132) if fp8_rows and (index == 0 or csa) else 2 * row_dim), f"F_KV{index}": int(fields[0]), f"F_SCORE{index}": int(fields[1]),
                           f"F_RING{index}": int(fields[2]), f"F_ROWS{index}": int(fields[3])})
        constexprs["NUM_SLOTS"] = num_slots
    signature.update({"inv_freq_ptr": "*fp32", "seq_info_ptr": "*i64", "fields_ptr": "*i64", "block_ids_ptr": "*i64",
                      "block_stride": "i32", "counters_ptr": "*i32", "rope_half": "i32"})
    constexprs.update(dict(NOPE=448, ROPE=64, BLOCK=64, NUM_BLOCKS=7, BLOCKS_P2=8, ROPE_P2=64, SCALE_OFFSET=576,
                           ROW_BYTES=584))
    return _compile(_compressor_step_kernel, signature, constexprs, 4, 1)


def main(argv: list[str] | None = None) -> int:
    from moemesh.bench.kernel_sass import summarise

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("sparse", "sparse-fp8", "fp8-writes", "indexer", "pool", "compressor-step",
                                             "all"),
                        default="all")
    args = parser.parse_args(argv)
    jobs = []
    if args.kernel in ("sparse", "all"):
        for block_h, block_n, warps, stages in ((16, 32, 8, 1), (32, 32, 8, 1), (16, 16, 4, 1), (64, 32, 8, 1)):
            jobs.append((f"sparse_h{block_h}_n{block_n}_w{warps}_s{stages}",
                         lambda h=block_h, n=block_n, w=warps, s=stages: compile_sparse(block_h=h, block_n=n,
                                                                                         num_warps=w, num_stages=s)))
        jobs.append(("sparse_hca_split", lambda: compile_sparse(block_h=16, block_n=32, num_warps=8, num_stages=1,
                                                                use_topk=False, split=True)))
    if args.kernel in ("sparse-fp8", "all"):  # FP8 main rows: the decode tile and the FP8 prefill tile
        for block_h, warps, stages in ((16, 8, 2), (32, 8, 1)):
            for use_topk in (True, False):
                jobs.append((f"sparse_fp8_h{block_h}_s{stages}_{'csa' if use_topk else 'hca'}",
                             lambda h=block_h, w=warps, s=stages, k=use_topk: compile_sparse(
                                 block_h=h, block_n=32, num_warps=w, num_stages=s, use_topk=k, fp8_rows=True)))
    if args.kernel in ("fp8-writes", "all"):
        jobs.append(("fp8_ring_write", lambda: compile_fp8_row_writes(ring=True)))
        jobs.append(("fp8_rows_write", lambda: compile_fp8_row_writes(ring=False, predicated=True)))
    if args.kernel in ("indexer", "all"):
        jobs.append(("indexer_n64", lambda: compile_indexer()))
        for num_rows in (2048, 4096, 16384):
            for fp8_rows in (False, True):
                jobs.append((f"indexer_topk_{num_rows}{'_fp8' if fp8_rows else ''}",
                             lambda n=num_rows, f=fp8_rows: compile_indexer_scores_topk(num_rows=n, fp8_rows=f)))
    if args.kernel in ("pool", "all"):
        jobs.append(("pool_csa", lambda: compile_pool(overlap=True)))
        jobs.append(("pool_hca", lambda: compile_pool(overlap=False)))
    if args.kernel in ("compressor-step", "all"):
        for csa in (True, False):
            for fp8_rows in (False, True):
                jobs.append((f"compressor_step_{'csa' if csa else 'hca'}{'_fp8' if fp8_rows else ''}",
                             lambda c=csa, f=fp8_rows: compile_compressor_step(csa=c, fp8_rows=f)))
    for name, job in jobs:
        summary = summarise(job())
        opcodes = summary.pop("opcodes")
        summary["HGMMA"] = opcodes.get("HGMMA", 0)
        summary["HMMA"] = opcodes.get("HMMA", 0)
        print(json.dumps({"variant": name, **summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
