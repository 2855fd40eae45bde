"""Sampler: greedy, reproducibility, filters and penalties against plain references, logprobs."""

import random

import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.sampling.batch import SamplingBatch
from moemesh.services.attention.sampling.penalties import build_token_history
from moemesh.common.sampling.rng import Purpose, stream, streams_for_rows
from moemesh.services.attention.sampling.sampler import Sampler, process_logits

NUM_VOCAB = 200


def _logits(num_rows: int, seed: int = 0, num_vocab: int = NUM_VOCAB) -> torch.Tensor:
    return torch.randn(num_rows, num_vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _process(logits, params, prompts=None, outputs=None):
    num_rows, num_vocab = logits.shape
    batch = SamplingBatch.from_params(params, num_vocab, "cpu")
    history = None
    if batch.penalty_rows:
        prompts = prompts or [[] for _ in params]
        outputs = outputs or [[] for _ in params]
        history = build_token_history(
            [prompts[r] for r in batch.penalty_rows], [outputs[r] for r in batch.penalty_rows], num_vocab, "cpu"
        )
    return process_logits(logits, batch, history)


# ---- straightforward references, one row at a time ----

def _ref_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.where(row >= kth, row, float("-inf"))


def _ref_top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = row.softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += probs[token]
        if mass >= top_p:
            break
    return torch.tensor([v if t in kept else float("-inf") for t, v in enumerate(row.tolist())])


def _ref_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = row.softmax(-1)
    return torch.where(probs >= min_p * probs.max(), row, float("-inf"))


def _ref_penalties(row, prompt, output, presence, frequency, repetition):
    values = row.tolist()
    for token in set(prompt) | set(output):
        values[token] = values[token] / repetition if values[token] > 0 else values[token] * repetition
    for token in set(output):
        values[token] -= frequency * output.count(token) + presence
    return torch.tensor(values)


# ---- tests ----

def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = _logits(5)
    logits[2, [17, 40, 3]] = 100.0  # three-way tie: 3 must win
    params = [SamplingParams()] * 5
    out = Sampler().sample(logits, params, [None] * 5, [[]] * 5, [[]] * 5)
    expected = logits.argmax(-1)
    assert out.token_ids.tolist() == expected.tolist()
    assert out.token_ids[2] == 3


def test_mixed_batch_greedy_rows_unaffected_by_sampled_rows():
    logits = _logits(4)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(), SamplingParams(temperature=0.5, top_k=3, seed=2)]
    gens = streams_for_rows([None, 1, None, 2], Purpose.SAMPLE, [0, 0, 0, 0])
    out = Sampler().sample(logits, params, gens, [[]] * 4, [[]] * 4)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    assert int(out.token_ids[3]) in logits[3].topk(3).indices.tolist()


def test_seeded_sampling_is_independent_of_batch_composition_and_order():
    num_rows = 12
    logits = _logits(num_rows, seed=3)
    params = [SamplingParams(temperature=1.0 + 0.1 * i, top_p=0.95 if i % 2 else 1.0, seed=100 + i) for i in range(num_rows)]
    sampler = Sampler()

    def run(rows):
        gens = [stream(params[r].seed, Purpose.SAMPLE, 4) for r in rows]
        out = sampler.sample(logits[rows], [params[r] for r in rows], gens, [[]] * len(rows), [[]] * len(rows))
        return dict(zip(rows, out.token_ids.tolist()))

    alone = {}
    for r in range(num_rows):
        alone.update(run([r]))
    order = list(range(num_rows))
    random.Random(0).shuffle(order)
    assert run(order) == alone
    assert run(order[:5] + [0]) == {r: alone[r] for r in order[:5] + [0]}
    # a different position (another stream) changes some draws: the streams are really used
    gens = [stream(params[r].seed, Purpose.SAMPLE, 5) for r in range(num_rows)]
    moved = sampler.sample(logits, params, gens, [[]] * num_rows, [[]] * num_rows).token_ids.tolist()
    assert moved != [alone[r] for r in range(num_rows)]


def test_sampled_row_without_generator_is_refused():
    logits = _logits(1)
    try:
        Sampler().sample(logits, [SamplingParams(temperature=1.0)], [None], [[]], [[]])
    except ValueError:
        return
    raise AssertionError("sampled row without a stream was accepted")


def test_top_k_top_p_min_p_match_references():
    logits = _logits(9, seed=5)
    params = [
        SamplingParams(temperature=0.8, top_k=7),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=30, top_p=0.95, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=NUM_VOCAB + 50),  # larger than V: no-op
        SamplingParams(temperature=2.0),
    ]
    processed = _process(logits, params)
    for row, p in enumerate(params):
        ref = logits[row] / p.temperature
        if p.top_k is not None:
            ref = _ref_top_k(ref, min(p.top_k, NUM_VOCAB))
        if p.top_p < 1.0:
            ref = _ref_top_p(ref, p.top_p)
        if p.min_p > 0:
            ref = _ref_min_p(ref, p.min_p)
        assert torch.equal(torch.isinf(processed[row]), torch.isinf(ref)), row
        finite = ~torch.isinf(ref)
        torch.testing.assert_close(processed[row][finite], ref[finite])
    assert int((~torch.isinf(processed[0])).sum()) == 7
    assert int((~torch.isinf(processed[1])).sum()) == 1


def test_penalties_match_openai_and_hf_formulas():
    logits = _logits(4, seed=9)
    prompts = [[1, 2, 3, 3], [5], [], [7, 8]]
    outputs = [[3, 4, 4, 4, 9], [5, 5, 6], [10, 11], []]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=0.9, repetition_penalty=0.8),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
        SamplingParams(temperature=1.0),  # no penalties: untouched
    ]
    processed = _process(logits, params, prompts, outputs)
    for row, p in enumerate(params):
        ref = _ref_penalties(logits[row], prompts[row], outputs[row], p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        ref = ref / (p.temperature if p.temperature > 0 else 1.0)
        torch.testing.assert_close(processed[row], ref)


def test_greedy_with_repetition_penalty_changes_the_argmax():
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 2.0, 1.5
    out = Sampler().sample(logits, [SamplingParams(repetition_penalty=2.0)], [None], [[4]], [[]])
    assert out.token_ids.tolist() == [6]


def test_logprobs_are_log_softmax_of_processed_logits():
    logits = _logits(3, seed=11)
    params = [
        SamplingParams(num_logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.9, seed=4, num_logprobs=3),
        SamplingParams(temperature=1.0, top_k=4, seed=5, num_logprobs=0, frequency_penalty=0.4),
    ]
    outputs = [[], [], [1, 2]]
    gens = streams_for_rows([None, 4, 5], Purpose.SAMPLE, [0, 0, 2])
    out = Sampler().sample(logits, params, gens, [[]] * 3, outputs)
    expected = _process(logits, params, None, outputs).log_softmax(-1)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprob_ids.shape == (3, 5)
    ref_values, ref_ids = expected.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, ref_values)
    assert torch.isinf(out.top_logprobs[2, 4])  # top-k 4 left only 4 finite logprobs
    assert out.top_logprob_ids[0].tolist() == ref_ids[0].tolist()


def test_input_logits_are_not_modified_and_bf16_is_accepted():
    logits = _logits(2).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_p=0.5, seed=1, repetition_penalty=1.5), SamplingParams()]
    gens = streams_for_rows([1, None], Purpose.SAMPLE, [0, 0])
    out = Sampler().sample(logits, params, gens, [[1, 2]] * 2, [[3]] * 2)
    assert torch.equal(logits, before)
    assert out.logprobs.dtype == torch.float32
