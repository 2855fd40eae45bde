"""QuantizedRoutedExperts equals RoutedExperts on the dequantised weights, on any subset of experts."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.checkpoint.quant import quantize_fp4
from moemesh.common.kernels.moe_layout import sort_by_expert
from moemesh.common.model.moe import ExpertNotHeld, MultiHolderExperts, RoutedExperts
from moemesh.common.model.quantized_experts import (ExpertFormat, QuantizedRoutedExperts, dequantized_expert_weights,
                                                    layout_by_expert)
from moemesh.common.model.random_init import random_fp4_stack, random_fp8_stack

NUM_EXPERTS, HIDDEN, INTER, TOP_K, LIMIT = 8, 64, 32, 3, 10.0


def _holder(fmt: ExpertFormat, layers=(0, 1), seed: int = 0, **kwargs) -> QuantizedRoutedExperts:
    gen = torch.Generator().manual_seed(seed)
    make = random_fp4_stack if fmt is ExpertFormat.FP4 else random_fp8_stack
    stacks = {}
    for layer in layers:
        w1, s1 = make(NUM_EXPERTS, INTER, HIDDEN, generator=gen)
        w2, s2 = make(NUM_EXPERTS, HIDDEN, INTER, generator=gen)
        w3, s3 = make(NUM_EXPERTS, INTER, HIDDEN, generator=gen)
        stacks[layer] = (list(range(NUM_EXPERTS)), (w1, s1, w2, s2, w3, s3))
    return QuantizedRoutedExperts(stacks, NUM_EXPERTS, LIMIT, expert_format=fmt, **kwargs)


def _routing(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)]).sort(-1).values
    weights = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen) * 3  # large enough that the clamps act
    return hidden, ids, weights


@pytest.mark.parametrize("fmt", [ExpertFormat.FP4, ExpertFormat.FP8])
@pytest.mark.parametrize("before_w2", [False, True])
def test_equals_routed_experts_on_dequantised_weights(fmt, before_w2):
    holder = _holder(fmt, route_weight_before_w2=before_w2)
    reference = RoutedExperts(dequantized_expert_weights(holder), LIMIT, route_weight_before_w2=before_w2)
    hidden, ids, weights = _routing(11, seed=2)
    # FP4 on the CPU runs the native kernel (cpu_experts), whose sums run in another order: 1e-5 relative
    tolerance = dict(rtol=1e-5, atol=1e-5) if fmt is ExpertFormat.FP4 else {}
    for layer in (0, 1):
        out = holder(layer, hidden, ids, weights)
        torch.testing.assert_close(out, reference(layer, hidden, ids, weights), **tolerance)
        assert out.abs().max() > 0
    assert holder.pairs == reference.pairs


def test_fp4_stack_reads_back_what_the_checkpoint_quantizer_wrote():
    gen = torch.Generator().manual_seed(4)
    floats = [torch.randn(INTER, HIDDEN, generator=gen) for _ in range(3)]
    quantized = [quantize_fp4(w) for w in floats]
    tensors = {(0, e): (quantized[0][0], quantized[0][1], *quantize_fp4(floats[1].T.contiguous()),
                        quantized[2][0], quantized[2][1]) for e in (2, 5)}
    holder = QuantizedRoutedExperts.from_expert_tensors(tensors, NUM_EXPERTS, LIMIT)
    w1, w2, w3 = dequantized_expert_weights(holder)[(0, 5)]
    for restored, original in ((w1, floats[0]), (w2, floats[1].T), (w3, floats[2])):
        assert (restored - original).abs().max() <= original.abs().max() / 4  # e2m1: 1 mantissa bit
    assert holder.pairs == [(0, 2), (0, 5)]


def test_subsets_raise_and_combine_like_multi_holder():
    full = _holder(ExpertFormat.FP4)
    reference = RoutedExperts(dequantized_expert_weights(full), LIMIT)
    weights_by_pair = {}
    for layer, held in full._layers.items():
        for index, expert in enumerate(held.expert_ids):
            weights_by_pair[(layer, expert)] = tuple(t[index] for t in (held.w1, held.s1, held.w2, held.s2,
                                                                        held.w3, held.s3))
    low = QuantizedRoutedExperts.from_expert_tensors({k: v for k, v in weights_by_pair.items() if k[1] < 4},
                                                     NUM_EXPERTS, LIMIT)
    high = QuantizedRoutedExperts.from_expert_tensors({k: v for k, v in weights_by_pair.items() if k[1] >= 4},
                                                      NUM_EXPERTS, LIMIT)
    hidden, ids, weights = _routing(9, seed=7)
    with pytest.raises(ExpertNotHeld):
        low(0, hidden, ids, weights)
    assert low.holds(0, 3) and not low.holds(0, 4) and not low.holds(2, 0)
    assert torch.equal(low.held_mask(1, ids), ids < 4)
    combined = MultiHolderExperts([low, high])(1, hidden, ids, weights)
    torch.testing.assert_close(combined, reference(1, hidden, ids, weights))
    masked = low.per_expert_outputs(0, hidden, ids, weights, slot_mask=ids < 4)
    assert torch.all(masked[ids >= 4] == 0) and masked[ids < 4].abs().sum() > 0


def test_layout_by_expert_matches_moe_layout():
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 16, (37, 6), generator=gen)
    ours, theirs = layout_by_expert(ids, 16), sort_by_expert(ids, 16)
    assert torch.equal(ours.expert_offsets, theirs.expert_offsets)
    assert torch.equal(ours.row_slot_ids, theirs.row_slot_ids)
    assert torch.equal(ours.row_token_ids, theirs.row_token_ids)
