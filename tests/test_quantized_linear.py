"""Fp8Linear / Fp8GroupedLinear and the module swap equal the float path on dequantised weights."""

from __future__ import annotations

import pytest
import torch

from moemesh.common.checkpoint.quant import quantize_fp8_block
from moemesh.common.kernels.reference import dequant_fp8_blockwise
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.config import AttentionKind, NumericsConfig
from moemesh.common.model.linear import GroupedLinear, Linear
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.quantized import Fp8GroupedLinear, Fp8Linear, KernelBackend, swap_fp8_linears
from moemesh.common.model.quantized_experts import dequantized_expert_weights
from moemesh.common.model.random_init import (fp8_linear_names, random_fp8_linear, random_model, tiny_flash_like_config)
from moemesh.common.model.reference import ReferenceModel


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (64, 32)])
def test_fp8_linear_equals_linear_on_dequantised_weight(shape):
    gen = torch.Generator().manual_seed(shape[0])
    original = torch.randn(*shape, generator=gen)
    weight, scale = quantize_fp8_block(original)
    reference = Linear(shape[1], shape[0], dtype=torch.float32)
    reference.weight.data = dequant_fp8_blockwise(weight, scale)
    x = torch.randn(5, 3, shape[1], generator=gen)
    fp8 = Fp8Linear(weight, scale)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight.shape == shape
    # the checkpoint quantizer's format is read back: e4m3 keeps 3 mantissa bits (error <= 2^-4 relative)
    assert ((fp8.dequantized() - original).abs() <= original.abs() / 16 + 2**-9 * original.abs().max()).all()
    torch.testing.assert_close(fp8(x), reference(x))


def test_a_small_cpu_fp8_linear_keeps_its_dense_weight_until_the_fp8_weight_changes(monkeypatch):
    from moemesh.common.model import linear

    weight, scale = random_fp8_linear(256, 384, generator=torch.Generator().manual_seed(3))
    fp8 = Fp8Linear(weight, scale)
    x = torch.randn(4, 384)
    first = fp8(x)
    torch.testing.assert_close(first, x @ fp8.dequantized().t(), rtol=0, atol=1e-5)
    kept = fp8._dense._entry[1]
    assert torch.equal(kept, fp8.dequantized())
    fp8(x)
    assert fp8._dense._entry[1] is kept  # not rebuilt by a second call
    fp8.scale.add_(1)  # every block's exponent + 1: twice the weight, written in place
    torch.testing.assert_close(fp8(x), 2 * first, rtol=0, atol=1e-5)
    assert fp8._dense._entry[1] is not kept
    monkeypatch.setattr(linear, "CPU_WIDE_WEIGHT_MAX_BYTES", 256 * 384 * 4 - 1)
    large = Fp8Linear(weight, scale)
    torch.testing.assert_close(large(x), x @ large.dequantized().t(), rtol=0, atol=1e-5)
    assert large._dense._entry is None  # above the bound: dequantised in row blocks per call, nothing kept


def test_a_bf16_cpu_linear_keeps_its_float32_copy_until_its_weight_changes():
    head = Linear(64, 96, dtype=torch.bfloat16)
    head.weight.data = torch.randn(96, 64).bfloat16()
    x = torch.randn(3, 64)
    torch.testing.assert_close(head(x), x @ head.weight.float().t(), rtol=0, atol=1e-5)
    kept = head._wide._entry[1]
    assert kept.dtype == torch.float32 and torch.equal(kept, head.weight.float())
    head(x)
    assert head._wide._entry[1] is kept
    head.weight.mul_(2)  # in place: the kept copy is stale and rebuilt
    torch.testing.assert_close(head(x), x @ head.weight.float().t(), rtol=0, atol=1e-5)
    assert head._wide._entry[1] is not kept
    assert head(x.bfloat16()).dtype == torch.bfloat16 and head._wide._entry[1].dtype == torch.float32


def test_cpu_routed_experts_keep_their_dequantised_matrices_until_the_stack_changes():
    config = tiny_flash_like_config([AttentionKind.WINDOW])
    _, experts = random_model(config, "cpu", seed=5)
    layer = next(iter(experts._layers))
    held = experts._layers[layer]
    hidden = torch.randn(3, config.hidden_size)
    first = held.matrices(0, hidden)
    assert all(torch.equal(a, _dequant(w[0], s[0], held.fmt)) for a, (w, s) in
               zip(first, ((held.w1, held.s1), (held.w2, held.s2), (held.w3, held.s3)), strict=True))
    assert all(a is b for a, b in zip(held.matrices(0, hidden), first, strict=True))  # kept
    held.s2[0].add_(1)  # expert 0's w2 doubled in place: rebuilt
    again = held.matrices(0, hidden)
    assert torch.equal(again[1], 2 * first[1]) and again[1] is not first[1]


def _dequant(w, s, fmt):
    from moemesh.common.model.quantized_experts import _dequant_stacked

    return _dequant_stacked(w, s, fmt)


def test_fp8_linear_rejects_wrong_scale_grid():
    weight, scale = random_fp8_linear(256, 256)
    with pytest.raises(ValueError, match="scale"):
        Fp8Linear(weight, scale[:1])


def test_fp8_grouped_linear_equals_grouped_linear():
    gen = torch.Generator().manual_seed(3)
    num_groups, in_per_group, out_per_group = 4, 96, 40
    weight, scale = random_fp8_linear(num_groups * out_per_group, in_per_group, generator=gen)
    reference = GroupedLinear(in_per_group, num_groups * out_per_group, num_groups, dtype=torch.float32)
    reference.weight.data = dequant_fp8_blockwise(weight, scale)
    x = torch.randn(7, num_groups, in_per_group, generator=gen)
    torch.testing.assert_close(Fp8GroupedLinear(weight, scale, num_groups)(x), reference(x))


def test_random_fp8_linear_has_unit_gain_and_varied_scales():
    weight, scale = random_fp8_linear(512, 1024, generator=torch.Generator().manual_seed(0))
    dense = dequant_fp8_blockwise(weight, scale)
    std = dense.std().item()
    assert 0.5 * 1024**-0.5 < std < 2 * 1024**-0.5
    assert torch.isfinite(dense).all()
    assert len(torch.unique(scale)) > 1


def _float_twin(side, experts, config):
    """The same model with every quantized tensor dequantised into plain Linear / RoutedExperts."""
    from moemesh.common.model.attention_side import AttentionSide

    state = {}
    for name, tensor in side.state_dict().items():
        if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in side.state_dict():
            continue
        module_name = name.removesuffix(".weight")
        module = side.get_submodule(module_name) if name.endswith(".weight") else None
        state[name] = module.dequantized() if isinstance(module, Fp8Linear) else tensor
    twin = AttentionSide.from_state_dict(config, state, side.numerics)
    routed = RoutedExperts.from_config(dequantized_expert_weights(experts), config, side.numerics)
    return twin, routed


def test_swapped_model_equals_float_model_on_dequantised_weights():
    config = tiny_flash_like_config([AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA])
    side, experts = random_model(config, "cpu", seed=5)
    names = fp8_linear_names(config)
    assert all(isinstance(side.get_submodule(n.removesuffix(".weight")), Fp8Linear) for n in names)
    assert any(isinstance(side.get_submodule(n.removesuffix(".weight")), Fp8GroupedLinear) for n in names)
    twin, routed = _float_twin(side, experts, config)
    assert not any(isinstance(m, Fp8Linear) for m in twin.modules())
    tokens = torch.randint(0, config.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    quantized_model, float_model = ReferenceModel(side, experts), ReferenceModel(twin, routed)
    states = [quantized_model.new_sequence(), float_model.new_sequence()]
    prefill = [m.forward(tokens[:60], [SequenceChunk(s, 60)]) for m, s in zip((quantized_model, float_model), states)]
    torch.testing.assert_close(prefill[0], prefill[1], rtol=1e-5, atol=1e-5)
    for t in range(60, 70):  # decode continues identically
        out = [m.forward(tokens[t:t + 1], [SequenceChunk(s, 1)]) for m, s in zip((quantized_model, float_model), states)]
        torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)


def test_swap_checks_names_and_shapes():
    config = tiny_flash_like_config([AttentionKind.HCA])
    side, _ = random_model(config, "cpu")
    weight, scale = random_fp8_linear(8, 8)
    with pytest.raises(KeyError):
        swap_fp8_linears(side, {"layers.0.attn.nonexistent.weight": (weight, scale)})
    with pytest.raises(ValueError, match="FP8 weight"):
        swap_fp8_linears(side, {"layers.0.attn.wq_a.weight": (weight, scale)})
    module = side.get_submodule("layers.0.attn.wq_a")
    fresh = random_fp8_linear(module.out_features, module.in_features)
    assert swap_fp8_linears(side, {"layers.0.attn.wq_a.weight": fresh}, backend=KernelBackend.TORCH) == [
        "layers.0.attn.wq_a"]
    assert side.get_submodule("layers.0.attn.wq_a").weight.data_ptr() == fresh[0].data_ptr()


def test_numerics_default_is_float32_on_cpu():
    config = tiny_flash_like_config([AttentionKind.CSA])
    side, _ = random_model(config, "cpu")
    assert side.numerics == NumericsConfig(dtype="float32")
    assert side.embed.weight.dtype == torch.float32 and side.embed.weight.device.type == "cpu"
