"""The sampler and verifier on a CUDA device: same greedy results as CPU, seeded reproducibility."""

import pytest
import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.sampling.rng import Purpose, stream, streams_for_rows
from moemesh.services.attention.sampling.sampler import Sampler
from moemesh.services.attention.sampling.verify import verify

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _params():
    return [
        SamplingParams(repetition_penalty=1.2, num_logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, seed=1, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, top_k=5, seed=2),
        SamplingParams(),
    ]


def test_greedy_rows_and_logprobs_match_cpu():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    params = _params()
    ids = [[1, 2, 3]] * 4
    cpu = Sampler().sample(logits, params, streams_for_rows([None, 1, 2, None], Purpose.SAMPLE, [0] * 4), ids, ids)
    gpu = Sampler().sample(
        logits.cuda(), params, streams_for_rows([None, 1, 2, None], Purpose.SAMPLE, [0] * 4, "cuda"), ids, ids
    )
    assert gpu.token_ids.device.type == "cuda"
    assert gpu.token_ids[[0, 3]].tolist() == cpu.token_ids[[0, 3]].tolist()
    torch.testing.assert_close(gpu.top_logprobs.cpu(), cpu.top_logprobs, rtol=1e-4, atol=1e-4)


def test_seeded_rows_reproducible_alone_and_in_batch():
    logits = torch.randn(4, 1000, device="cuda")
    params = _params()
    ids = [[1, 2, 3]] * 4
    batch = Sampler().sample(
        logits, params, streams_for_rows([None, 1, 2, None], Purpose.SAMPLE, [5] * 4, "cuda"), ids, ids
    ).token_ids.tolist()
    for row in (1, 2):
        alone = Sampler().sample(
            logits[row : row + 1], [params[row]], [stream(params[row].seed, Purpose.SAMPLE, 5, "cuda")], ids[:1], ids[:1]
        ).token_ids.tolist()
        assert alone == [batch[row]]


def test_verify_runs_on_cuda_and_greedy_matches_cpu():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 4, 500, generator=generator)
    drafts = logits[:, :3].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % 500
    draft_probs = torch.rand(4, 3, 500, generator=generator).softmax(-1)
    params = _params()
    seeds = [None, 1, 2, None]
    ids = [[7]] * 4
    cpu = verify(logits, drafts, draft_probs, params, seeds, [3] * 4, ids, ids)
    gpu = verify(logits.cuda(), drafts.cuda(), draft_probs.cuda(), params, seeds, [3] * 4, ids, ids)
    assert gpu.emitted_token_ids[3] == cpu.emitted_token_ids[3] == drafts[3].tolist() + [int(logits[3, 3].argmax())]
    assert gpu.num_accepted[1] == cpu.num_accepted[1]  # acceptance uniforms come from the host hash
    again = verify(logits.cuda(), drafts.cuda(), draft_probs.cuda(), params, seeds, [3] * 4, ids, ids)
    assert again.emitted_token_ids == gpu.emitted_token_ids
