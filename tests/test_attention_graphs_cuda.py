"""CUDA-graph decode steps of the serving attention worker (services/attention/graph_decode.py) on CUDA.

Graph replays against ModelRunner's eager loop (Triton kernels, per-forward tables), step by step
and token for token, with sequences joining and leaving, windows of both ratios closing, the
indexer's width class changing, and two micro-batches: a tiny model in fp32 and V4-Flash width in
bf16 (`bench.checks.decode_graphs`). Skipped without CUDA.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FLASH_TOLERANCE = 3e-2  # bf16; padded batches run the linears at the bucket's size


@pytest.mark.parametrize("case_index", [0, 1, 2, 3])
def test_tiny_graph_replays_match_eager(case_index):
    from moemesh.bench.checks.decode_graphs import CUDA_CASES, prefill_counts, run_graph_case, tiny_graph_config

    case = CUDA_CASES[case_index]
    result = run_graph_case(case, tiny_graph_config(), torch.device("cuda"), capture=True, dtype="float32")
    print(asdict(result))  # shown by `pytest -rA` (bench/device/decode-graphs.sh)
    short, long = prefill_counts(case)
    assert result.num_graph_steps == case.num_decode_steps + short, result  # decode, verification, short prompts
    assert result.eager_reasons == ({"chunk_too_long": long} if long else {}), result
    assert result.num_captures >= 2, result  # buckets / width classes change during the script
    assert result.max_relative_error < 1e-4, result
    assert result.state_relative_error < 1e-4, result
    assert result.num_token_mismatches == 0, result


def test_flash_width_graph_replays_match_eager():
    from moemesh.bench.checks.decode_graphs import FLASH_CASES, flash_graph_config, prefill_counts, run_graph_case

    case = FLASH_CASES[0]
    result = run_graph_case(case, flash_graph_config(), torch.device("cuda"), capture=True, dtype="bfloat16")
    print(asdict(result))
    assert result.num_graph_steps == case.num_decode_steps + prefill_counts(case)[0], result
    assert result.max_relative_error < FLASH_TOLERANCE, result
    assert result.state_relative_error < FLASH_TOLERANCE, result
    assert result.num_token_mismatches == 0, result
