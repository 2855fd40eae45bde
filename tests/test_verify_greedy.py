"""Verifier on hand-made cases: greedy exact match + bonus, per-slot penalties, edge cases."""

import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.sampling.batch import SamplingBatch
from moemesh.services.attention.sampling.penalties import build_token_history
from moemesh.common.sampling.rng import Purpose, stream
from moemesh.services.attention.sampling.sampler import Sampler, process_logits
from moemesh.services.attention.sampling.verify import verify

NUM_VOCAB = 6
GREEDY = SamplingParams()


def _one_hot_logits(token_ids_per_slot: list[int]) -> torch.Tensor:
    """[W1, V] logits whose argmax at slot k is token_ids_per_slot[k]."""
    logits = torch.zeros(len(token_ids_per_slot), NUM_VOCAB)
    for slot, token in enumerate(token_ids_per_slot):
        logits[slot, token] = 5.0
    return logits


def _verify_greedy(target_tokens, drafts, num_draft_tokens=None, params=GREEDY, prompt=(), output=()):
    logits = _one_hot_logits(target_tokens).unsqueeze(0)
    return verify(
        logits, torch.tensor([drafts]), None, [params], [None], [len(output)],
        [list(prompt)], [list(output)], num_draft_tokens=num_draft_tokens,
    )


def test_all_drafts_match_emits_them_plus_bonus():
    out = _verify_greedy([2, 4, 1, 5], [2, 4, 1])
    assert out.num_accepted == (3,)
    assert out.emitted_token_ids == [[2, 4, 1, 5]]
    assert out.accepted_mask.tolist() == [[True, True, True]]


def test_first_mismatch_emits_target_token_and_ignores_later_matches():
    out = _verify_greedy([2, 4, 1, 5], [2, 3, 1])
    assert out.num_accepted == (1,)
    assert out.emitted_token_ids == [[2, 4]]
    assert out.accepted_mask.tolist() == [[True, False, False]]


def test_immediate_mismatch_emits_one_token():
    out = _verify_greedy([2, 4, 1, 5], [0, 4, 1])
    assert out.num_accepted == (0,)
    assert out.emitted_token_ids == [[2]]


def test_fewer_drafts_than_slots_take_the_bonus_at_their_own_slot():
    out = _verify_greedy([2, 4, 1, 5], [2, 4, 1], num_draft_tokens=[1])
    assert out.num_accepted == (1,)
    assert out.emitted_token_ids == [[2, 4]]
    assert out.num_draft_tokens == (1,)


def test_batch_of_requests_is_verified_row_by_row():
    logits = torch.stack([_one_hot_logits([1, 2, 3]), _one_hot_logits([3, 3, 0]), _one_hot_logits([5, 4, 3])])
    drafts = torch.tensor([[1, 2], [3, 1], [0, 0]])
    out = verify(logits, drafts, None, [GREEDY] * 3, [None] * 3, [0, 0, 0], [[]] * 3, [[]] * 3)
    assert out.num_accepted == (2, 1, 0)
    assert out.emitted_token_ids == [[1, 2, 3], [3, 3], [5]]


def test_greedy_penalties_count_earlier_drafts_of_the_block():
    # slot 1 prefers token 2 (2.0) over 3 (1.5); draft 0 is 2, so a repetition penalty of 2
    # at slot 1 halves it to 1.0 and the target now wants 3
    logits = torch.zeros(1, 3, NUM_VOCAB)
    logits[0, 0, 2] = 3.0
    logits[0, 1, 2], logits[0, 1, 3] = 2.0, 1.5
    logits[0, 2, 1] = 3.0
    drafts = torch.tensor([[2, 2]])
    plain = verify(logits, drafts, None, [GREEDY], [None], [0], [[]], [[]])
    assert plain.emitted_token_ids == [[2, 2, 1]]
    penalised = verify(logits, drafts, None, [SamplingParams(repetition_penalty=2.0)], [None], [0], [[]], [[]])
    assert penalised.emitted_token_ids == [[2, 3]]


def test_zero_drafts_equals_plain_sampling_with_the_same_stream():
    logits = torch.randn(1, 1, 50, generator=torch.Generator().manual_seed(1))
    for seed in range(20):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed, presence_penalty=0.3)
        out = verify(logits, torch.zeros(1, 0, dtype=torch.int64), None, [params], [seed], [7], [[1]], [[4, 5]])
        plain = Sampler().sample(logits[:, 0], [params], [stream(seed, Purpose.SAMPLE, 7)], [[1]], [[4, 5]])
        assert out.emitted_token_ids == [plain.token_ids.tolist()]


def test_sampled_slots_use_sampler_processing_with_drafts_in_the_history():
    num_vocab, num_slots = 30, 4
    logits = torch.randn(1, num_slots, num_vocab, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.8, top_k=10, frequency_penalty=0.7, repetition_penalty=1.3, seed=3, num_logprobs=2)
    prompt, output = [1, 2], [3, 3]
    drafts = logits[0, :3].argmax(-1)  # in every slot's top-k, so accepted once p_d == p_t
    batch = SamplingBatch.from_params([params], num_vocab, "cpu")
    ref_logprobs, ref_probs = [], []
    for slot in range(num_slots):
        history = build_token_history([prompt], [output + drafts[:slot].tolist()], num_vocab, "cpu")
        processed = process_logits(logits[:, slot], batch, history)[0]
        ref_probs.append(processed.softmax(-1))
        ref_logprobs.append(processed.log_softmax(-1))
    draft_probs = torch.stack(ref_probs[:3]).unsqueeze(0)  # p_d = p_t: every draft is accepted
    out = verify(logits, drafts.unsqueeze(0), draft_probs, [params], [3], [2], [prompt], [output])
    assert out.num_accepted == (3,)
    emitted = out.emitted_token_ids[0]
    assert emitted[:3] == drafts.tolist()
    expected = [float(ref_logprobs[slot][token]) for slot, token in enumerate(emitted)]
    torch.testing.assert_close(torch.tensor(out.emitted_logprobs[0]), torch.tensor(expected))
    assert out.top_logprobs.shape == (1, num_slots, 2)


def test_target_probability_zero_is_never_accepted():
    # top-k 1 at temperature > 0 leaves one token; a draft of anything else must be rejected
    logits = torch.tensor([[[0.0, 3.0, 1.0, 0.5], [1.0, 0.0, 0.0, 0.0]]])
    params = SamplingParams(temperature=1.0, top_k=1)
    draft_probs = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]])
    for seed in range(10):
        out = verify(logits, torch.tensor([[2]]), draft_probs, [params], [seed], [0], [[]], [[]])
        assert out.emitted_token_ids == [[1]]
