"""Draft verification in the attention worker's step: emitted tokens and the state after rejections.

An in-process attention worker (tiny random checkpoint: window 8, CSA ratio 4, HCA ratio 8; one
expert worker process) decodes one copy of a prompt plainly and another with drafts (some right,
some wrong) in the same steps. The drafted copy must emit exactly the plain tokens and, after
its rejected drafts are rolled back, hold the same SequenceState as plain decoding, tensor by tensor.
"""

from __future__ import annotations

import pytest
import torch

from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import ScheduledSequence, StepPlan
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
from moemesh.common.placement.worker_holdings import WorkerHoldings

PROMPT = [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13]  # 13 tokens: verify chunks cross 16 (CSA + HCA close)
GREEDY = SamplingParams(max_tokens=64).to_wire()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    config = tiny_config()
    path = tmp_path_factory.mktemp("spec_ckpt")
    write_checkpoint(path, config, random_hub_state_dict(config, seed=5, include_mtp=False))
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("spec_experts")),
                       num_expert_workers=1, placement="all", with_attention=False)
    with LocalCluster(spec) as cluster:
        pairs = tuple((layer, expert) for layer in range(config.num_hidden_layers)
                      for expert in range(config.n_routed_experts))
        holdings = (WorkerHoldings(cluster.expert_names[0], pairs),)
        attention = AttentionWorker(AttentionWorkerConfig(
            name="attention-spec", checkpoint_path=str(path), expert_endpoints=(cluster.endpoint_of(cluster.expert_names[0]),),
            expert_workers=holdings, dispatch_timeout_s=30.0))
        attention.load_now()
        yield attention
        attention.channel.close()


class Runner:
    def __init__(self, worker):
        self.worker = worker
        self.step_id = 0

    def step(self, *sequences):
        self.step_id += 1
        result = self.worker.step(StepPlan(step_id=self.step_id, sequences=tuple(sequences)))
        return {answer.request_id: answer for answer in result.sequences}


def _seq(request_id, slot, tokens, start, drafts=(), first=False):
    return ScheduledSequence(request_id, slot, tuple(tokens) + tuple(drafts), start, ((slot,),), True,
                             GREEDY if first else None, tuple(drafts))


def test_drafts_emit_plain_tokens_and_rollback_leaves_the_plain_state(worker):
    run = Runner(worker)
    answers = run.step(_seq("plain", 0, PROMPT, 0, first=True), _seq("spec", 1, PROMPT, 0, first=True))
    plain = list(answers["plain"].token_ids)
    assert answers["spec"].token_ids == answers["plain"].token_ids
    for _ in range(10):  # plain greedy decoding, one token per step
        plain += run.step(_seq("plain", 0, plain[-1:], len(PROMPT) + len(plain) - 1))["plain"].token_ids
    spec = [plain[0]]
    cases = [(2, 2), (0, 3), (4, 0)]  # (right drafts, wrong drafts after them)
    for num_right, num_wrong in cases:
        position = len(PROMPT) + len(spec) - 1
        right = plain[len(spec):len(spec) + num_right]
        wrong = [(token + 1) % 200 for token in plain[len(spec) + num_right:len(spec) + num_right + num_wrong]]
        answer = run.step(_seq("spec", 1, spec[-1:], position, right + wrong))["spec"]
        assert answer.error is None
        assert answer.num_draft_accepted == num_right
        assert list(answer.token_ids) == plain[len(spec):len(spec) + num_right + 1]  # accepted + target's token
        spec += answer.token_ids
        assert worker.slots.slots[1].state.num_tokens == len(PROMPT) + len(spec) - 1  # rejected ones rolled back
    # the plain copy at the same length, state compared tensor by tensor
    plain_state = _state_after(worker, run, plain, len(spec))
    left, right = worker.slots.slots[1].state.live_tensors(), plain_state.live_tensors()
    assert set(left) == set(right)
    for name in left:
        assert left[name].shape == right[name].shape, name
        assert (left[name].float() - right[name].float()).abs().max() < 1e-4, name  # chunk vs token-wise rounding


def _state_after(worker, run, plain, num_outputs):
    """Replay `plain` in slot 2 token by token up to the spec copy's committed length."""
    run.step(_seq("replay", 2, PROMPT, 0, first=True))
    for index in range(num_outputs - 1):
        run.step(_seq("replay", 2, [plain[index]], len(PROMPT) + index))
    return worker.slots.slots[2].state
