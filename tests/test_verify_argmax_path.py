"""The worker's argmax verification (draft_verification.accept_by_argmax, greedy requests without bias, penalties or
logprobs) emits what the general verifier (sampling.verify.verify) emits, on random steps with ties, mixed
draft counts and rows of undrafted sequences between the drafted ones."""

import random
from dataclasses import dataclass

import pytest
import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.draft_verification import DraftedRow, _verify_general, accept_by_argmax, argmax_only


@dataclass
class _Scheduled:
    request_id: str
    draft_token_ids: tuple[int, ...]


@dataclass
class _Slot:
    params: SamplingParams
    seed: int | None = None
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()


def _random_step(rng: random.Random, num_vocab: int):
    """Logits [R, V] of a step (bf16 values on a coarse grid: ties are common) and its drafted rows."""
    rows, num_drafts, row = [], [], 0
    for b in range(rng.randint(1, 4)):
        row += rng.randint(0, 2)  # rows of sequences that sample without drafts
        num = rng.randint(1, 6)
        rows.append((b, row, num))
        row += num + 1
    logits = torch.randint(0, 4, (row + rng.randint(0, 2), num_vocab)).to(torch.bfloat16)  # [R, V]
    drafted = []
    for b, first_row, num in rows:
        targets = logits[first_row:first_row + num + 1].float().argmax(-1).tolist()
        # drafts that follow the target for a random prefix, then anything
        keep = rng.randint(0, num)
        drafts = tuple(targets[k] if k < keep else rng.randrange(num_vocab) for k in range(num))
        drafted.append(DraftedRow(_Scheduled(f"r{b}", drafts), _Slot(SamplingParams()), first_row))
        num_drafts.append(num)
    return logits, drafted, num_drafts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_argmax_path_equals_the_general_verifier(device):
    rng = random.Random(7)
    for _ in range(200):
        logits, drafted, num_drafts = _random_step(rng, num_vocab=rng.choice([3, 5, 17]))
        logits = logits.to(device)
        accepted, emitted = accept_by_argmax(drafted, num_drafts, logits.argmax(-1).tolist())
        accepted_ref, emitted_ref, _ = _verify_general(drafted, num_drafts, logits)
        assert accepted == accepted_ref
        assert emitted == emitted_ref


def test_argmax_only_leaves_out_what_changes_the_target_token():
    assert argmax_only(SamplingParams())
    assert not argmax_only(SamplingParams(temperature=0.7))
    assert not argmax_only(SamplingParams(repetition_penalty=1.2))
    assert not argmax_only(SamplingParams(logit_bias=((3, 5.0),)))
    assert not argmax_only(SamplingParams(num_logprobs=0))
