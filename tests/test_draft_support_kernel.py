"""The sampled draft slot's kernel (common/kernels/draft_support.py) against its torch reference
(`chains.sparse_slot_draw`): the same support ids bit for bit, q within the softmax's rounding, the same drawn
token. CPU: under TRITON_INTERPRET=1 at small sizes, in one child process; CUDA: the default model's and
V4-Flash's vocabularies."""

from __future__ import annotations

import pytest
import torch

from interpret_support import INTERPRETING, cuda, interpreted, patch_interpreter, run_interpreted_tests
from moemesh.common.drafting.chains import sparse_slot_draw
from moemesh.common.sampling.rng import key_exponentials

patch_interpreter()


def _inputs(num_rows: int, num_vocab: int, support_k: int, device: str, seed: int, bf16_values: bool):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, num_vocab, generator=generator) * 3  # [R, V]
    if bf16_values:  # few distinct values: ties at the K-th place
        logits = logits.bfloat16().float()
    divisors = torch.rand(num_rows, 1, generator=generator) * 1.5 + 0.3  # [R, 1]
    keys = torch.randint(-(2**62), 2**62, (num_rows,), generator=generator)
    noise = key_exponentials(keys, support_k)  # [R, K]
    return logits.to(device), divisors.to(device), noise.to(device)


def _assert_kernel_equals_reference(num_rows: int, num_vocab: int, support_k: int, device: str, seed: int,
                                    bf16_values: bool = False) -> None:
    from moemesh.common.kernels.draft_support import sparse_slot_draw_kernel

    logits, divisors, noise = _inputs(num_rows, num_vocab, support_k, device, seed, bf16_values)
    ids, probs, drawn, drawn_q = sparse_slot_draw_kernel(logits, divisors, noise, support_k)
    want_ids, want_probs, want_drawn, want_q = sparse_slot_draw(logits, divisors, noise, support_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-9)
    assert torch.equal(drawn, want_drawn)
    torch.testing.assert_close(drawn_q, want_q, rtol=1e-5, atol=1e-9)
    assert bool((drawn == ids.gather(1, (probs / noise).argmax(dim=1, keepdim=True)).squeeze(1)).all())


def test_interpreted_cases_pass_in_a_child_process():
    run_interpreted_tests(__file__, keyword="interpreted_", timeout_s=900)


@interpreted
@pytest.mark.parametrize("num_vocab,support_k,bf16_values", [(700, 64, False), (700, 64, True), (3000, 16, True),
                                                             (129, 64, False)])
def test_interpreted_kernel_equals_reference(num_vocab, support_k, bf16_values):
    _assert_kernel_equals_reference(3, num_vocab, support_k, "cpu", seed=num_vocab + support_k,
                                    bf16_values=bf16_values)


def test_a_support_that_is_not_a_power_of_two_below_the_vocabulary_is_refused():
    from moemesh.common.kernels.draft_support import sparse_slot_draw_kernel

    logits, divisors, noise = _inputs(1, 100, 48, "cpu", 0, False)
    with pytest.raises(ValueError, match="support_k=48"):
        sparse_slot_draw_kernel(logits, divisors, noise, 48)
    with pytest.raises(ValueError, match="support_k=128"):
        sparse_slot_draw_kernel(logits, divisors, key_exponentials(torch.zeros(1, dtype=torch.long), 128), 128)


def test_chunks_keep_the_candidates_within_bounds():
    from moemesh.common.kernels.draft_support import MAX_CANDIDATES, chunk_size

    for num_vocab, support_k in ((12288, 64), (129280, 64), (700, 64), (129280, 16)):
        chunk = chunk_size(num_vocab, support_k)
        assert chunk >= support_k and -(-num_vocab // chunk) * support_k <= MAX_CANDIDATES


@cuda
@pytest.mark.skipif(INTERPRETING, reason="compiled")
@pytest.mark.parametrize("num_vocab", [12288, 129280])
@pytest.mark.parametrize("num_rows", [1, 4])
def test_kernel_equals_reference_on_cuda(num_vocab, num_rows):
    for bf16_values in (False, True):
        _assert_kernel_equals_reference(num_rows, num_vocab, 64, "cuda", seed=num_vocab + num_rows,
                                        bf16_values=bf16_values)
