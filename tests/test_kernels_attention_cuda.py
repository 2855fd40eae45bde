"""Batched attention kernels vs the torch path at V4-Flash width on CUDA (bf16), plus CUDA-graph
capture of a decode step. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cases():
    from moemesh.bench.checks.attention import cuda_cases

    return cuda_cases()


@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_flash_width_matches_torch(case_index):
    from moemesh.bench.checks.attention import BF16_TOLERANCE, run_case
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import flash_config

    config = flash_config((AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA))
    case = _cases()[case_index]
    result = run_case(case, config, torch.bfloat16, "cuda", BF16_TOLERANCE)
    assert result.all_finite, case.name
    assert result.relative_error <= BF16_TOLERANCE, (case.name, result.relative_error)


def test_flash_width_output_rotated_back_in_the_launch():
    from moemesh.bench.checks.attention import check_rotate_back
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import flash_config

    result = check_rotate_back(flash_config((AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA)),
                               torch.bfloat16, "cuda")
    assert result.passed, result


def test_decode_step_replays_in_a_cuda_graph():
    """Captured once, a decode step replayed gives the same output as the eager kernel path."""
    from moemesh.bench.checks.attention import random_layers
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import fill_random_context, flash_config, new_sequence_state

    config = flash_config((AttentionKind.CSA, AttentionKind.HCA))
    layers = random_layers(config, torch.bfloat16, "cuda", seed=1)
    generator = torch.Generator(device="cuda").manual_seed(0)
    states = []
    for num_tokens in (1000, 203, 4095):
        state = new_sequence_state(config, 4200, torch.bfloat16, "cuda")
        fill_random_context(state, num_tokens, generator=generator)
        states.append(state)
    x = torch.randn(len(states), config.hidden_size, device="cuda", dtype=torch.bfloat16)

    def step() -> list[torch.Tensor]:
        batch = ForwardBatch([SequenceChunk(s, 1) for s in states], "cuda", attention_backend=AttentionBackend.TRITON)
        return batch, [layer(x, batch) for layer in layers]

    with torch.inference_mode():
        batch, eager = step()
        for state in states:
            for layer_state in state.layers:
                for store in layer_state.stores():
                    store.rollback(1)
        batch = ForwardBatch([SequenceChunk(s, 1) for s in states], "cuda", attention_backend=AttentionBackend.TRITON)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            captured = [layer(x, batch) for layer in layers]
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)


def test_indexer_scores_at_flash_width():
    from moemesh.bench.checks.attention import check_indexer_scores
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import flash_config

    config = flash_config((AttentionKind.CSA, AttentionKind.HCA))
    result = check_indexer_scores(config, torch.bfloat16, "cuda", 1e-2)
    assert result.all_finite and result.relative_error <= 1e-2, result
