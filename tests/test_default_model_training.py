"""The training code of the default model (tools/train) at the smoke size: its forward is the model
core's, a few steps learn, the DSpark distillation learns, the export reads back as trained."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.config import ModelConfig
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.tools.train.drafter import TrainableDrafter, drafter_loss, sample_anchors, teacher_outputs
from moemesh.tools.train.settings import model_config_dict
from moemesh.tools.train.target import TrainableTarget, masked_cross_entropy

VOCAB = 12288
SEQ = 160  # > window 128 and > HCA ratio 128 (one HCA row), 40 CSA rows > top-16


@pytest.fixture(scope="module")
def config():
    return ModelConfig.from_dict(model_config_dict("smoke", VOCAB))


def _tokens(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 600, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def test_training_forward_equals_reference_model(config):
    target = TrainableTarget(config, seed=0, device="cpu")
    ids = _tokens(2, 1)
    with torch.no_grad():
        h, _ = target.forward_streams(ids)
        ours = target.logits_from_streams(h).view(2, SEQ, -1)
    hub = target.hub_state_dict()
    side = AttentionSide.from_state_dict(config, hub)
    experts = {(l, e): tuple(hub[f"layers.{l}.ffn.experts.{e}.{w}.weight"] for w in ("w1", "w2", "w3"))
               for l in range(config.num_hidden_layers) for e in range(config.n_routed_experts)}
    reference = ReferenceModel(side, RoutedExperts.from_config(experts, config))
    for i in range(2):
        torch.testing.assert_close(reference.forward_sequence(ids[i]), ours[i], rtol=1e-4, atol=1e-4)


def test_target_and_drafter_learn_a_fixed_batch(config):
    torch.manual_seed(0)
    target = TrainableTarget(config, seed=0, device="cpu")
    ids, mask = _tokens(2, 2), torch.ones(2, SEQ)
    params = [p for p in target.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(6):
        h, _ = target.forward_streams(ids)
        logits = target.logits_from_streams(h).view(2, SEQ, -1)
        loss, _ = masked_cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                       mask[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5
    for p in target.parameters():
        p.requires_grad_(False)
    drafter = TrainableDrafter(config, target, seed=1, device="cpu")
    assert not any(name.startswith(("embed", "head")) for name in drafter.hub_state_dict())
    features, teacher = teacher_outputs(target, ids)
    anchors = sample_anchors(2, SEQ, config.dspark.block_size, 6, torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    embed_before = target.side.embed.weight.clone()
    draft_losses = []
    for _ in range(6):
        terms = drafter_loss(drafter, ids, mask, features, teacher, anchors)
        optimizer.zero_grad()
        terms["loss"].backward()
        optimizer.step()
        draft_losses.append(float(terms["loss"].detach()))
    assert draft_losses[-1] < draft_losses[0]
    assert torch.equal(target.side.embed.weight, embed_before)  # shared embedding stays frozen


def test_batched_training_attention_equals_core_path(config):
    """`tools.train.batched_attention` (the fast training path) against the core's per-sequence
    decode-state path, logits and gradients, over a window long enough for every row kind."""
    target = TrainableTarget(config, seed=4, device="cpu")
    ids = _tokens(2, 5)
    h_fast, captured_fast = target.forward_streams(ids, (3, 5), batched=True)
    h_core, captured_core = target.forward_streams(ids, (3, 5), batched=False)
    torch.testing.assert_close(h_fast, h_core, rtol=1e-4, atol=1e-4)
    for a, b in zip(captured_fast, captured_core):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    wq = target.side.layers[3].attn.compressor.wkv.weight  # HCA compressor: a gradient path of its own
    grads = []
    for h in (h_fast, h_core):
        (grad,) = torch.autograd.grad(target.logits_from_streams(h).logsumexp(-1).mean(), wq)
        grads.append(grad)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-6)
