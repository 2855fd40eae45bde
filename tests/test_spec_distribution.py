"""Sampled speculation through the serving path emits the target's distribution.

A tiny random DeepSeek-V4 with a DSpark drafter and a vocabulary of V = 8 tokens. N requests with
the same prompt and different seeds run through the router's scheduler and draft coordinator, the
real attention worker (causal verification with rejection sampling, rollback; experts in an
expert worker process) and the real draft worker (tests/spec_inprocess.py). Each request decodes
MAX_TOKENS tokens: x1 from the prefill's plain sample, then x2.. from verify steps with up to
W drafts (accepted drafts, residual resamples, bonus tokens). The test compares the joint of
(x2, x3) — the first two tokens verification produced — with the target's exact joint
P(x2, x3) = Σ_x1 p(x1) p(x2 | x1) p(x3 | x1, x2), computed by the single-process reference model
on every context (V + V² forwards), after the request's sampling processing (temperature,
top-p). Pearson chi-square, fixed seeds, p > 0.001 to pass.

Power (computed in the test, on the actual target joint): a "5 % bias" is the emitted joint
being 0.95 · target + 0.05 · r, for r the joint the drafts themselves follow (the error a broken
verifier makes: it leans toward the drafter) and for r uniform. The probability that the same
chi-square test at the same N rejects such a biased joint is estimated by simulation (400
multinomial samples) and asserted >= 0.9, so the sample size is shown to be enough.

Cases: temperature 1 with the checkpoint's own (random) drafter, drafting greedily (q all on the argmax, the
serving default) and sampling its drafts (marked slow); temperature 0.8 with top-p 0.9
(the target has zeros) and a deliberately wrong drafter (its head rows permuted, its Markov bias
sharpened and negated) whose proposals are truncated to 5 of the 8 tokens (q has zeros the target
has not); the same wrong drafter at temperature 1 (marked slow). The emitted distribution must not
change. Every case also checks that speculation ran: drafts verified, some accepted, some rejected.
Runtime: ~20 s a case on an idle 2-core host (N requests batched per step), plus ~10 s of set-up.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.services.attention.sampling.batch import SamplingBatch
from moemesh.services.attention.sampling.sampler import process_logits
from chi_square_support import chi_square_p_value
from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
from moemesh.common.speculation_width import SpeculationConfig, SpeculationMode
from moemesh.common.drafting.proposer import DrafterConfig
from moemesh.services.draft.worker import DraftWorker
from moemesh.common.placement.worker_holdings import WorkerHoldings
from moemesh.services.router.scheduler import SchedulerConfig
from spec_inprocess import SpecLoop

pytestmark = pytest.mark.timeout(300)

NUM_VOCAB = 8
BLOCK = 4  # dspark_block_size; fixed width = BLOCK drafts per verify step
PROMPT = (3, 1, 4, 1, 5, 2)
MAX_TOKENS = 5  # x1 plain; the first verify step carries min(BLOCK, MAX_TOKENS - 2) = 3 drafts
NUM_REQUESTS = 1000
NUM_BLOCKS = NUM_REQUESTS + 8  # one KV block per request (prompt + output < 128 tokens)
ALPHA = 0.001
MIN_POWER = 0.9


def _config():
    return tiny_config(vocab_size=NUM_VOCAB, max_position_embeddings=192, compress_ratios=[0, 4, 128, 4, 0, 0, 0], num_nextn_predict_layers=3,
                       dspark_block_size=BLOCK, dspark_markov_rank=32, dspark_target_layer_ids=[1, 2, 3],
                       dspark_noise_token_id=NUM_VOCAB - 1)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread in this process: with other processes busy (the expert worker, other
    tests), intra-op threads that spin-wait made each step 10-20x slower on a 2-core host."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, one_thread):
    """(checkpoint path, model config, loaded attention worker, reference model)."""
    from moemesh.commands.generate import _load_model

    config = _config()
    hub_sd = random_hub_state_dict(config, seed=17)
    hub_sd["head.weight"] = hub_sd["head.weight"] * 6  # a target far from uniform (the test's power rests on it)
    hub_sd["mtp.2.markov_head.markov_w2.weight"] = hub_sd["mtp.2.markov_head.markov_w2.weight"] * 8
    path = tmp_path_factory.mktemp("spec_dist_ckpt")
    write_checkpoint(path, config, hub_sd)
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("spec_dist_run")),
                       num_expert_workers=1, placement="all", with_attention=False)
    with LocalCluster(spec) as cluster:
        pairs = tuple((layer, expert) for layer in range(config.num_hidden_layers)
                      for expert in range(config.n_routed_experts))
        attention = AttentionWorker(AttentionWorkerConfig(
            name="attention-dist", checkpoint_path=str(path),
            expert_endpoints=(cluster.endpoint_of(cluster.expert_names[0]),),
            expert_workers=(WorkerHoldings(cluster.expert_names[0], pairs),), dispatch_timeout_s=60.0,
            kv=KVPoolConfig(num_primary_blocks=NUM_BLOCKS)))
        attention.load_now()
        reference, _ = _load_model(str(path), "float32", "cpu")
        yield str(path), config, attention, reference
        asyncio.run(attention.close())


def _draft_worker(path: str, max_support: int | None, wrong: bool, draft_sampling: str) -> DraftWorker:
    worker = DraftWorker(DrafterConfig(checkpoint_path=path, max_support=max_support, draft_sampling=draft_sampling,
                                       speculation=SpeculationConfig(SpeculationMode.FIXED, width=BLOCK)))
    asyncio.run(worker.load())
    if wrong:
        with torch.no_grad():
            permutation = torch.randperm(NUM_VOCAB, generator=torch.Generator().manual_seed(3))
            worker.drafter.head.weight.copy_(worker.drafter.head.weight[permutation])
            worker.drafter.mtp[-1].markov_head.markov_w2.weight.mul_(-4.0)
    return worker


def _processed_probs(reference, contexts: list[tuple[int, ...]], params: SamplingParams) -> torch.Tensor:
    """p(next | context) after the request's processing, [C, V], from the reference model."""
    from moemesh.common.model.batch import SequenceChunk

    states = [reference.new_sequence() for _ in contexts]
    token_ids = torch.tensor([t for context in contexts for t in context], dtype=torch.long)
    last = torch.tensor([len(c) for c in contexts]).cumsum(0) - 1
    logits = reference.forward(token_ids, [SequenceChunk(s, len(c)) for s, c in zip(states, contexts)], last)
    batch = SamplingBatch.from_params([params] * len(contexts), NUM_VOCAB, "cpu")
    return process_logits(logits.float(), batch, None).softmax(-1).double()


def _target_joint(reference, params: SamplingParams) -> torch.Tensor:
    """P(x2, x3) [V * V] (row x2, column x3), marginal over x1."""
    first = _processed_probs(reference, [PROMPT], params)[0]  # [V]
    second = _processed_probs(reference, [PROMPT + (a,) for a in range(NUM_VOCAB)], params)  # [V(x1), V(x2)]
    third = _processed_probs(reference, [PROMPT + (a, b) for a in range(NUM_VOCAB) for b in range(NUM_VOCAB)],
                             params).view(NUM_VOCAB, NUM_VOCAB, NUM_VOCAB)  # [x1, x2, x3]
    joint = (first[:, None, None] * second[:, :, None] * third).sum(0)  # [x2, x3]
    return joint.flatten()


def _counts(pairs: torch.Tensor) -> torch.Tensor:
    return torch.bincount(pairs[:, 0] * NUM_VOCAB + pairs[:, 1], minlength=NUM_VOCAB * NUM_VOCAB)


def _power(expected: torch.Tensor, other: torch.Tensor, num_samples: int, seed: int) -> float:
    """P(chi-square rejects at ALPHA) when samples follow 0.95 expected + 0.05 other (simulated)."""
    biased = 0.95 * expected + 0.05 * other / other.sum()
    generator = torch.Generator().manual_seed(seed)
    num_trials, num_rejected = 400, 0
    for _ in range(num_trials):
        draws = torch.multinomial(biased.float(), num_samples, replacement=True, generator=generator)
        counts = torch.bincount(draws, minlength=expected.numel())
        num_rejected += chi_square_p_value(counts, expected) < ALPHA
    return num_rejected / num_trials


CASES = {
    # name: (params without seed, max_support, wrong drafter, draft sampling)
    "temperature_1_greedy_drafts": (dict(temperature=1.0), None, False, "greedy"),
    "temperature_0.8_top_p_0.9_wrong_drafter_truncated_q": (dict(temperature=0.8, top_p=0.9), 5, True, "sampled"),
    "temperature_1_sampled_drafts": (dict(temperature=1.0), None, False, "sampled"),
    "temperature_1_wrong_drafter": (dict(temperature=1.0), None, True, "sampled"),
}
# the two others already cover both drafters and both draft samplings (~20 s each)
SLOW_CASES = {"temperature_1_sampled_drafts", "temperature_1_wrong_drafter"}


@pytest.mark.parametrize("case", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_CASES else [])
                                  for name in CASES])
def test_emitted_tokens_follow_the_target_through_the_worker(stack, case):
    path, _, attention, reference = stack
    param_fields, max_support, wrong, draft_sampling = CASES[case]
    draft_worker = _draft_worker(path, max_support, wrong, draft_sampling)
    loop = SpecLoop(attention, draft_worker, SchedulerConfig(
        num_gpu_blocks=NUM_BLOCKS, max_model_len=64, max_num_batched_tokens=8 * NUM_REQUESTS,
        long_prefill_token_threshold=64, max_num_running_seqs=NUM_REQUESTS, enable_prefix_caching=False),
        max_draft_tokens=BLOCK)
    for index in range(NUM_REQUESTS):
        seed = 100_000 * list(CASES).index(case) + index
        loop.add(f"{case}-{index}", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, seed=seed, **param_fields))
    loop.run()
    outputs = loop.outputs()
    assert all(len(tokens) == MAX_TOKENS for tokens in outputs.values())
    # speculation ran: every request verified drafts, some accepted (emitted as drafted), some rejected
    # (replaced by a residual draw); at temperature 1 with sampled drafts also past the first draft position
    # (a greedy draft of this random drafter is accepted with the target's probability of it, about 1/8)
    drafted, accepted = loop.drafts.draft_by_position, loop.drafts.accepted_by_position
    assert drafted[0] >= NUM_REQUESTS and drafted[1] >= NUM_REQUESTS
    assert 0 < accepted[0] < drafted[0], (drafted, accepted)
    if param_fields["temperature"] == 1.0 and draft_sampling == "sampled":
        assert 0 < accepted[1] < drafted[1], (drafted, accepted)

    params = SamplingParams(max_tokens=MAX_TOKENS, **param_fields)
    expected = _target_joint(reference, params)
    pairs = torch.tensor([tokens[1:3] for tokens in outputs.values()])
    p_value = chi_square_p_value(_counts(pairs), expected)
    assert p_value > ALPHA, f"{case}: emitted (x2, x3) differ from the target (p = {p_value:.2e})"

    # the drafts alone (the first verify step's two leading drafts) follow another joint: the
    # test rejects them, and at this N it has the power to see a 5 % lean toward them or uniform
    draft_counts = _counts(torch.tensor([loop.first_drafts[request_id][:2] for request_id in outputs]))
    assert chi_square_p_value(draft_counts, expected) < ALPHA
    for name, other in (("toward the drafts", draft_counts.double()), ("toward uniform", torch.ones_like(expected))):
        power = _power(expected, other, NUM_REQUESTS, seed=1)
        print(f"{case}: p = {p_value:.3f}, accepted by position {accepted} of {drafted}, power {name} {power:.3f}")
        assert power >= MIN_POWER, f"{case}: power {power:.2f} against a 5 % bias {name} at N = {NUM_REQUESTS}"
