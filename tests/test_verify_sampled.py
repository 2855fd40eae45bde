"""Temperature-only sampled verification (sampling/verify_sampled.py, as the worker calls it through
draft_verification._verify_simple) emits exactly what the general verifier (sampling.verify.verify) emits: the same
accepted counts and tokens on random steps with acceptances, rejections, resamples and bonus draws, greedy
and sampled requests mixed."""

import random
import re
from dataclasses import dataclass, field

import pytest
import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.sampling.verify_sampled import temperature_only
from moemesh.services.attention.draft_verification import DraftedRow, _verify_general, _verify_simple, argmax_only


@dataclass
class _Scheduled:
    request_id: str
    draft_token_ids: tuple[int, ...]
    draft_support_token_ids: tuple[tuple[int, ...], ...] = ()
    draft_support_probs: tuple[tuple[float, ...], ...] = ()


@dataclass
class _Slot:
    params: SamplingParams
    seed: int | None
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: tuple[int, ...] = ()


def _support(rng: random.Random, num_vocab: int, must_hold: int, size: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    ids = sorted({must_hold, *rng.sample(range(num_vocab), size - 1)})
    weights = torch.tensor([rng.random() + (2.0 if i == must_hold else 0.0) for i in ids], dtype=torch.float32)
    probs = (weights / weights.sum()).tolist()
    return tuple(ids), tuple(probs)


def _random_step(rng: random.Random, num_vocab: int):
    rows, row = [], 0
    logits_rows = []
    for b in range(rng.randint(1, 4)):
        skip = rng.randint(0, 1)  # an undrafted sequence's row between drafted ones
        logits_rows.append(torch.randn(skip, num_vocab))
        row += skip
        num_drafts = rng.randint(1, 5)
        target = torch.randn(num_drafts + 1, num_vocab) * rng.choice([1.0, 3.0])
        logits_rows.append(target)
        greedy = rng.random() < 0.3
        temperature = 0.0 if greedy else rng.choice([0.5, 1.0, 1.3])
        drafts, supports, probs = [], [], []
        for k in range(num_drafts):
            token = int(target[k].argmax()) if rng.random() < 0.7 else rng.randrange(num_vocab)
            drafts.append(token)
            ids, values = _support(rng, num_vocab, token, min(num_vocab, rng.choice([4, 8])))
            supports.append(ids)
            probs.append(values)
        scheduled = _Scheduled(f"r{b}", tuple(drafts), () if greedy else tuple(supports), () if greedy else tuple(probs))
        slot = _Slot(SamplingParams(temperature=temperature), None if greedy else rng.randrange(1 << 40),
                     output_token_ids=[0] * rng.randint(0, 9))
        rows.append(DraftedRow(scheduled, slot, row))
        row += num_drafts + 1
    return torch.cat(logits_rows), rows


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_temperature_only_verification_equals_the_general_verifier(device):
    rng = random.Random(11)
    seen_rejection = seen_bonus = 0
    for _ in range(150):
        num_vocab = rng.choice([16, 40])
        logits, rows = _random_step(rng, num_vocab)
        logits = logits.to(device)
        num_drafts = [len(row.scheduled.draft_token_ids) for row in rows]
        greedy = [argmax_only(row.slot.params) for row in rows]
        assert all(g or temperature_only(row.slot.params, num_vocab) for g, row in zip(greedy, rows))
        accepted, emitted = _verify_simple(rows, num_drafts, logits, greedy, None)
        accepted_ref, emitted_ref, _ = _verify_general(rows, num_drafts, logits)
        assert accepted == accepted_ref
        assert emitted == emitted_ref
        seen_rejection += sum(a < n for a, n in zip(accepted, num_drafts))
        seen_bonus += sum(a == n for a, n in zip(accepted, num_drafts))
    assert seen_rejection > 20 and seen_bonus > 20  # both draws were exercised


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=0.8), True),
    (SamplingParams(temperature=0.8, top_k=50), True),  # top_k >= the vocabulary (40) keeps every token
    (SamplingParams(temperature=0.8, top_k=5), False),
    (SamplingParams(temperature=0.8, top_p=0.9), False),
    (SamplingParams(temperature=0.8, min_p=0.1), False),
    (SamplingParams(temperature=0.8, presence_penalty=0.5), False),
    (SamplingParams(temperature=0.8, logit_bias=((1, 2.0),)), False),
    (SamplingParams(temperature=0.8, num_logprobs=2), False),
    (SamplingParams(), False),  # greedy: the argmax rule
])
def test_temperature_only(params, expected):
    assert temperature_only(params, num_vocab=40) is expected


@pytest.mark.parametrize("supports, probs, message", [
    (((1, 2),), ((0.5, 0.5),), "2 sampled drafts but 1 draft distributions"),
    (((1, 2), (3,)), ((0.5, 0.5), (0.5, 0.5)), "draft 1 has 1 ids, 2 probs"),
    (((1, 2), (3, 99)), ((0.5, 0.5), (0.5, 0.5)), "ids outside [0, 16)"),
])
def test_malformed_draft_distributions_are_refused_before_anything_changes(supports, probs, message):
    from moemesh.services.attention.draft_verification import verify_drafted

    slot = _Slot(SamplingParams(temperature=1.0), seed=3)
    row = DraftedRow(_Scheduled("bad", (1, 3), supports, probs), slot, 0)
    with pytest.raises(ValueError, match=re.escape(message)):
        verify_drafted([row], torch.randn(3, 16))
    assert slot.output_token_ids == []
