"""Training of the default model across runs (tools/train) at the smoke size: the sync-free expert
path equals the model core's, quantisation-aware training sees exactly what the export writes, a
run continues from an exported checkpoint without loss, the dataset pack round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moemesh.common.checkpoint.quant import dequantize_fp4, dequantize_fp8_block, quantize_fp4, quantize_fp8_block
from moemesh.common.model.config import ModelConfig
from moemesh.common.model.inventory import StorageKind
from moemesh.common.model.moe import RoutedExperts
from moemesh.tools.train.drafter import TrainableDrafter
from moemesh.tools.train.export import export_checkpoint, load_reference
from moemesh.tools.train.quant_shadow import QuantShadow, fake_quantize, stacked_expert_names
from moemesh.tools.train.settings import model_config_dict
from moemesh.tools.train.target import TrainableTarget, dense_routed_experts

VOCAB = 12288
SEQ = 160


@pytest.fixture(scope="module")
def config():
    return ModelConfig.from_dict(model_config_dict("smoke", VOCAB))


def _tokens(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 600, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def test_dense_routed_experts_equal_the_core_and_its_gradients():
    generator = torch.Generator().manual_seed(0)
    e, i, d, t, k = 4, 32, 16, 40, 2
    w1, w3 = torch.randn(e, i, d, generator=generator), torch.randn(e, i, d, generator=generator)
    w2 = torch.randn(e, d, i, generator=generator)
    x = torch.randn(t, d, generator=generator)
    ids = torch.stack([torch.randperm(e, generator=generator)[:k] for _ in range(t)]).sort(dim=1).values
    weights = torch.rand(t, k, generator=generator)
    params = [w.clone().requires_grad_(True) for w in (w1, w2, w3)]
    ours = dense_routed_experts(x, ids, weights, *params, swiglu_limit=2.0)
    core_params = [w.clone().requires_grad_(True) for w in (w1, w2, w3)]
    held = {(0, j): (core_params[0][j], core_params[1][j], core_params[2][j]) for j in range(e)}
    theirs = RoutedExperts(held, 2.0)(0, x, ids, weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    ours.square().sum().backward()
    theirs.square().sum().backward()
    for a, b in zip(params, core_params):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


def test_fake_quantize_is_what_the_writer_stores_and_is_idempotent():
    generator = torch.Generator().manual_seed(1)
    dense = torch.randn(256, 384, generator=generator) * 0.05
    stacked = torch.randn(3, 64, 96, generator=generator) * 0.05
    fp8 = fake_quantize(dense, StorageKind.FP8_BLOCK, (128, 128))
    assert torch.equal(fp8, dequantize_fp8_block(*quantize_fp8_block(dense, (128, 128)), block_size=(128, 128)))
    fp4 = fake_quantize(stacked, StorageKind.FP4_BLOCK, (1, 32))
    for j in range(3):
        assert torch.equal(fp4[j], dequantize_fp4(*quantize_fp4(stacked[j], 32)))
    assert torch.equal(fake_quantize(fp8, StorageKind.FP8_BLOCK, (128, 128)), fp8)
    assert torch.equal(fake_quantize(fp4, StorageKind.FP4_BLOCK, (1, 32)), fp4)


def test_quantized_step_keeps_float_masters_and_straight_through_gradients(config):
    target = TrainableTarget(config, seed=2, device="cpu")
    shadow = QuantShadow.for_modules(config, {**dict(target.side.named_parameters()),
                                              **stacked_expert_names(lambda l: f"layers.{l}.", target.experts)})
    assert shadow.num_params > 0
    weight = target.side.layers[0].attn.wq_a.weight
    before = weight.detach().clone()
    ids = _tokens(1, 3)
    with shadow.quantized():
        assert not torch.equal(weight, before)  # the forward sees the quantised values
        h, _ = target.forward_streams(ids)
        target.logits_from_streams(h).logsumexp(-1).mean().backward()
    assert torch.equal(weight, before)  # the master comes back
    assert weight.grad is not None and weight.grad.abs().max() > 0
    assert target.experts.w1[0].grad is not None


def test_training_continues_from_the_exported_checkpoint(config, tmp_path):
    from moemesh.tools.train.resume import has_drafter, load_drafter, load_target

    target = TrainableTarget(config, seed=5, device="cpu")
    drafter = TrainableDrafter(config, target, seed=6, device="cpu")
    named = {**dict(target.side.named_parameters()), **stacked_expert_names(lambda l: f"layers.{l}.", target.experts),
             **{n: p for n, p in drafter.drafter.named_parameters() if p.requires_grad},
             **stacked_expert_names(lambda s: f"mtp.{s}.", drafter.experts)}
    QuantShadow.for_modules(config, named).project()  # as at the end of a quantisation-aware run
    hub = {**target.hub_state_dict(), **drafter.hub_state_dict()}
    export_checkpoint(tmp_path, config, hub, None)
    assert has_drafter(tmp_path)

    resumed = TrainableTarget(config, seed=99, device="cpu")
    load_target(resumed, tmp_path)
    for name, tensor in target.hub_state_dict().items():
        assert torch.equal(resumed.hub_state_dict()[name], tensor), name  # nothing lost in the round trip
    resumed_drafter = TrainableDrafter(config, resumed, seed=98, device="cpu")
    load_drafter(resumed_drafter, tmp_path)
    for name, tensor in drafter.hub_state_dict().items():
        assert torch.equal(resumed_drafter.hub_state_dict()[name], tensor), name

    ids = _tokens(1, 7)
    reference, _ = load_reference(tmp_path)
    with torch.no_grad():
        h, _ = resumed.forward_streams(ids)
        ours = resumed.logits_from_streams(h)
    torch.testing.assert_close(reference.forward_sequence(ids[0]), ours, rtol=1e-4, atol=1e-4)


def test_dataset_pack_round_trip(tmp_path):
    from moemesh.tools.train.data_pack import pack, unpack

    source = tmp_path / "data"
    source.mkdir()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 12288, (3, 40), dtype=np.uint16)
    mask = (rng.random((3, 40)) < 0.6).astype(np.uint8)
    np.save(source / "train_ids.npy", ids)
    np.save(source / "train_loss_mask.npy", mask)
    (source / "manifest.json").write_text('{"streams": {"train": {"num_windows": 3}}}')
    size = pack(source, tmp_path / "data.pack")
    assert size > 0
    manifest = unpack(tmp_path / "data.pack", tmp_path / "out")
    assert manifest["streams"]["train"]["num_windows"] == 3
    assert np.array_equal(np.load(tmp_path / "out" / "train_ids.npy"), ids)
    out_mask = np.load(tmp_path / "out" / "train_loss_mask.npy")
    assert out_mask.dtype == np.uint8 and np.array_equal(out_mask, mask)


def test_recite_size_fits_the_hub_budget():
    from moemesh.common.model.inventory import tensor_inventory

    sizes = {size: sum(spec.num_bytes for spec in tensor_inventory(ModelConfig.from_dict(model_config_dict(size, VOCAB))).values())
             for size in ("full", "recite")}
    assert 25e6 < sizes["full"] < 26e6  # the shipped size, 25.3 MB
    assert 39e6 < sizes["recite"] < 40e6  # 39.2 MB: under 50 MB with room in a 64 MiB device transfer


def test_the_model_card_says_when_a_run_kept_the_target():
    from moemesh.tools.train.report import _target_line
    from moemesh.tools.train.settings import TrainSettings

    settings = TrainSettings()
    assert _target_line({"steps": 0}, settings) == "not trained in this run (kept as loaded: `--target-steps 0`)"
    line = _target_line({"steps": 12}, settings)
    assert line.startswith("12 steps × ") and f"peak lr {settings.target_lr}" in line
