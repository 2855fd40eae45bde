"""Rejection sampling is lossless: emitted tokens follow the target's (processed) distribution.

A tiny target "model" over V tokens whose logits depend on the last two tokens, and a Markov
drafter (logits from the last token, like DSpark's Markov head). Each of N rows is an
independent request (its own seed); rounds of draft -> verify run until every row has emitted
L tokens; the joint of the first L emitted tokens is compared with the target's joint by a
chi-square test. Drafts are drawn with Purpose.DRAFT streams, as the drafter will.
"""

import pytest
import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.sampling.batch import SamplingBatch
from moemesh.common.sampling.draw import sample_from_probs
from moemesh.common.sampling.rng import Purpose, stream
from moemesh.services.attention.sampling.sampler import process_logits
from chi_square_support import chi_square_p_value
from moemesh.services.attention.sampling.verify import verify

PROMPT = (0, 1)
NUM_ROWS = 30000


class TinyTarget:
    """logits(context) = last_table[context[-1]] + second_table[context[-2]], each [V, V]."""

    def __init__(self, num_vocab: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.num_vocab = num_vocab
        self.last_table = torch.randn(num_vocab, num_vocab, generator=generator) * 1.5
        self.second_table = torch.randn(num_vocab, num_vocab, generator=generator)

    def logits(self, last: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return self.last_table[last] + self.second_table[second]

    def processed_probs(self, last, second, params: SamplingParams) -> torch.Tensor:
        logits = self.logits(last, second)
        batch = SamplingBatch.from_params([params] * logits.shape[0], self.num_vocab, "cpu")
        return process_logits(logits, batch, None).softmax(-1)

    def joint(self, params: SamplingParams, num_tokens: int) -> torch.Tensor:
        """P(x_1..x_L) of plain sampling, [V] * L, by enumeration."""
        num_vocab = self.num_vocab
        joint = torch.ones(1)
        contexts = [PROMPT]
        for _ in range(num_tokens):
            last = torch.tensor([c[-1] for c in contexts])
            second = torch.tensor([c[-2] for c in contexts])
            step = self.processed_probs(last, second, params)  # [C, V]
            joint = (joint.unsqueeze(1) * step).flatten()
            contexts = [c + (t,) for c in contexts for t in range(num_vocab)]
        return joint


def _run(target: TinyTarget, draft_table: torch.Tensor, params: SamplingParams, num_drafts: int, num_tokens: int):
    """Emitted tokens [N, L] and, for a power check, the first round's raw drafts [N, W]."""
    seeds = list(range(1000, 1000 + NUM_ROWS))
    contexts = [list(PROMPT) for _ in seeds]
    outputs: list[list[int]] = [[] for _ in seeds]
    first_drafts = None
    while True:
        rows = [r for r in range(NUM_ROWS) if len(outputs[r]) < num_tokens]
        if not rows:
            break
        positions = [len(outputs[r]) for r in rows]
        row_seeds = [seeds[r] for r in rows]
        last = torch.tensor([contexts[r][-1] for r in rows])
        second = torch.tensor([contexts[r][-2] for r in rows])
        slot_logits, drafts, draft_probs = [target.logits(last, second)], [], []
        previous, before = last, second
        for slot in range(num_drafts):
            probs = draft_table[previous].softmax(-1)  # [N, V], Markov drafter
            gens = [stream(s, Purpose.DRAFT, p + slot) for s, p in zip(row_seeds, positions)]
            token = sample_from_probs(probs, gens)
            drafts.append(token)
            draft_probs.append(probs)
            previous, before = token, previous
            slot_logits.append(target.logits(previous, before))
        draft_ids = torch.stack(drafts, 1)
        if first_drafts is None:
            first_drafts = draft_ids
        result = verify(
            torch.stack(slot_logits, 1), draft_ids, torch.stack(draft_probs, 1),
            [params] * len(rows), row_seeds, positions, [list(PROMPT)] * len(rows), [outputs[r] for r in rows],
        )
        for r, emitted in zip(rows, result.emitted_token_ids):
            outputs[r].extend(emitted)
            contexts[r].extend(emitted)
    return torch.tensor([o[:num_tokens] for o in outputs]), first_drafts


def _joint_counts(tokens: torch.Tensor, num_vocab: int) -> torch.Tensor:
    cells = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for column in range(tokens.shape[1]):
        cells = cells * num_vocab + tokens[:, column]
    return torch.bincount(cells, minlength=num_vocab ** tokens.shape[1])


CASES = {
    # name: (vocab, params, draft kind, drafts per round, joint length)
    "temp1_close_drafter": (8, SamplingParams(temperature=1.0, seed=0), "close", 2, 2),
    "temp0.7_top_p0.9": (8, SamplingParams(temperature=0.7, top_p=0.9, seed=0), "close", 3, 2),
    "wrong_drafter": (8, SamplingParams(temperature=1.0, seed=0), "wrong", 2, 2),
    "three_positions_min_p": (6, SamplingParams(temperature=0.9, top_k=5, min_p=0.05, seed=0), "close", 3, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_joint_distribution_matches_target(case):
    num_vocab, params, draft_kind, num_drafts, num_tokens = CASES[case]
    target = TinyTarget(num_vocab, seed=5)
    noise = torch.randn(num_vocab, num_vocab, generator=torch.Generator().manual_seed(6))
    if draft_kind == "close":
        draft_table = target.last_table + 0.7 * noise  # plausible drafter: decent acceptance
    else:
        draft_table = -3.0 * target.last_table  # peaked on what the target finds unlikely
    tokens, first_drafts = _run(target, draft_table, params, num_drafts, num_tokens)
    expected = target.joint(params, num_tokens)
    counts = _joint_counts(tokens, num_vocab)
    assert chi_square_p_value(counts, expected) > 0.001, case
    # power: the unverified drafts are far from the target and the same test rejects them
    draft_counts = _joint_counts(first_drafts[:, :num_tokens], num_vocab)
    assert chi_square_p_value(draft_counts, expected) < 1e-6


def test_chi_square_detects_a_five_percent_bias_at_this_sample_size():
    """The test above could fail: a 5 % mixture of another distribution is caught."""
    target = TinyTarget(8, seed=5)
    params = SamplingParams(temperature=1.0, seed=0)
    expected = target.joint(params, 2)
    other = torch.full_like(expected, 1.0 / expected.numel())  # uniform: a mild kind of bias
    biased = 0.95 * expected + 0.05 * other
    samples = torch.multinomial(biased, NUM_ROWS, replacement=True, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(samples, minlength=expected.numel())
    assert chi_square_p_value(counts, expected) < 0.001
