"""The reference-numerics switches of `NumericsConfig` (docs/model.md §6): each changes what it should and
nothing else.

- shared_expert_clamp=False: the shared expert's SwiGLU is unclamped (matters only beyond ±limit).
- route_weight_before_w2=True: routing weight applied to the SwiGLU output before w2 (rounding only).
- kv_fp8_qat=True: window kv rows and compressed rows FP8-simulated on the nope channels.
Models are the docs/model.md §7.1 tiny model (weights from transformers' random init, see bench.checks.tiny_model).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.config import NumericsConfig
from moemesh.common.model.moe import MultiHolderExperts, RoutedExperts
from moemesh.common.model.qat import (E4M3_MAX, fp8_block_scales, fp8_quant_dequant, indexer_fp8_qat,
                                      kv_nope_fp8_qat, pow2_scale_ceil)
from moemesh.common.model.reference import ReferenceModel
from moemesh.bench.checks.tiny_model import random_hub_state_dict, split_hub_state_dict, tiny_config

SEQ_LEN = 56
# Full vs chunked forwards differ by fp32 rounding (~3e-7). With QAT such a difference can, rarely,
# move a kv element across an e4m3 rounding boundary: one e4m3 step (<= 1/8 relative) in one
# element, observed to move logits by ~2e-5. Inconsistent state (a step attending to values other
# than the ones it stores) moves them by ~0.1. The QAT tolerances sit between the two.
TOLERANCE = 1e-4
QAT_LOGITS_TOLERANCE = 2e-3
MAX_E4M3_FLIP_FRACTION = 0.01
# CSA first (so layer 0 has compressed rows whose inputs do not depend on earlier QAT), then window
# and HCA; head_dim 96 with 8 rotary dims gives 88 nope channels = one full 64-block + one of 24.
QAT_CONFIG = dict(
    layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    head_dim=96,
)


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _build(config, hub_sd, numerics: NumericsConfig) -> ReferenceModel:
    attention_sd, experts = split_hub_state_dict(hub_sd, config)
    side = AttentionSide.from_state_dict(config, attention_sd, numerics)
    dtype = numerics.torch_dtype()
    experts = {pair: tuple(w.to(dtype) for w in weights) for pair, weights in experts.items()}
    return ReferenceModel(side, RoutedExperts.from_config(experts, config, numerics))


@pytest.fixture(scope="module")
def spec_tiny():
    config = tiny_config()
    hub_sd, _ = random_hub_state_dict(config, seed=2024)
    tokens = torch.randint(0, config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(3))
    return config, hub_sd, tokens


@pytest.fixture(scope="module")
def qat_setup():
    config = tiny_config(**QAT_CONFIG)
    hub_sd, _ = random_hub_state_dict(config, seed=4321)
    tokens = torch.randint(0, config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(11))
    default = _build(config, hub_sd, NumericsConfig())
    qat = _build(config, hub_sd, NumericsConfig(kv_fp8_qat=True))
    default_state, qat_state = default.new_sequence(), qat.new_sequence()
    default_logits = default.forward(tokens, [SequenceChunk(default_state, SEQ_LEN)])
    qat_logits = qat.forward(tokens, [SequenceChunk(qat_state, SEQ_LEN)])
    return config, qat, tokens, (default_logits, default_state), (qat_logits, qat_state)


def test_reference_constructor_sets_all_three_switches():
    reference = NumericsConfig.reference("bfloat16")
    assert reference == NumericsConfig(dtype="bfloat16", shared_expert_clamp=False, route_weight_before_w2=True,
                                       kv_fp8_qat=True)
    assert NumericsConfig() != NumericsConfig.reference()


# ------------------------------------------------------------------------------------ shared-expert clamp
def _swiglu_reference(x, w1, w2, w3, limit):
    """Hand-written SwiGLU in float64: w2(silu(min(w1 x, L)) · clamp(w3 x, ±L)), no clamp if L is None."""
    x, w1, w2, w3 = (t.double() for t in (x, w1, w2, w3))
    gate, up = x @ w1.T, x @ w3.T
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (gate * torch.sigmoid(gate) * up) @ w2.T


def test_shared_expert_clamp_switch_on_the_attention_side_step(spec_tiny):
    config, hub_sd, _ = spec_tiny
    attention_sd, _ = split_hub_state_dict(hub_sd, config)
    clamped = AttentionSide.from_state_dict(config, attention_sd)
    unclamped = AttentionSide.from_state_dict(config, attention_sd, NumericsConfig(shared_expert_clamp=False))
    prefix = "layers.1.ffn.shared_experts."
    w1, w2, w3 = (attention_sd[prefix + f"{w}.weight"] for w in ("w1", "w2", "w3"))
    limit = config.swiglu_limit
    generator = torch.Generator().manual_seed(8)
    large = 40.0 * torch.randn(5, config.hidden_size, generator=generator)
    assert (large @ w1.T).max() > limit and (large @ w3.T).abs().max() > limit  # the clamp really bites
    out_clamped, out_unclamped = clamped.shared_expert(1, large), unclamped.shared_expert(1, large)
    assert (out_clamped - out_unclamped).abs().max() > 0.1 * out_clamped.abs().max()
    unclamped_expected = _swiglu_reference(large, w1, w2, w3, None)
    clamped_expected = _swiglu_reference(large, w1, w2, w3, limit)
    assert (out_unclamped.double() - unclamped_expected).abs().max() < 1e-4 * unclamped_expected.abs().max()
    assert (out_clamped.double() - clamped_expected).abs().max() < 1e-4 * clamped_expected.abs().max()
    small = 0.5 * torch.randn(5, config.hidden_size, generator=generator)
    assert (small @ w1.T).abs().max() < limit and (small @ w3.T).abs().max() < limit
    assert torch.equal(clamped.shared_expert(1, small), unclamped.shared_expert(1, small))


def _max_shared_pre_activation(model: ReferenceModel, tokens: torch.Tensor) -> float:
    """Largest |w1 x| or |w3 x| any shared expert sees during a forward over tokens."""
    seen = []

    def record(module, inputs, _output):
        x = inputs[0]
        seen.append(max(module.w1(x).abs().max().item(), module.w3(x).abs().max().item()))

    handles = [block.ffn.shared_experts.register_forward_hook(record) for block in model.side.layers]
    try:
        model.forward_sequence(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return max(seen)


def test_shared_expert_clamp_switch_in_the_model(spec_tiny):
    config, hub_sd, tokens = spec_tiny
    no_clamp = NumericsConfig(shared_expert_clamp=False)
    # small activations: the switch changes nothing, bit for bit
    default, reference = _build(config, hub_sd, NumericsConfig()), _build(config, hub_sd, no_clamp)
    assert _max_shared_pre_activation(default, tokens) < config.swiglu_limit
    assert torch.equal(default.forward_sequence(tokens), reference.forward_sequence(tokens))
    # shared-expert weights scaled so pre-activations exceed the limit: outputs differ
    scaled = dict(hub_sd)
    for layer in range(config.num_hidden_layers):
        for w in ("w1", "w3"):
            name = f"layers.{layer}.ffn.shared_experts.{w}.weight"
            scaled[name] = hub_sd[name] * 400.0
    default, reference = _build(config, scaled, NumericsConfig()), _build(config, scaled, no_clamp)
    assert _max_shared_pre_activation(default, tokens) > config.swiglu_limit
    difference = (default.forward_sequence(tokens) - reference.forward_sequence(tokens)).abs().max()
    assert difference > 1e-3


# ------------------------------------------------------------------------------------ routing weight order
def test_route_weight_before_w2_matches_a_hand_computed_token(spec_tiny):
    config, hub_sd, _ = spec_tiny
    _, experts = split_hub_state_dict(hub_sd, config)
    after = RoutedExperts.from_config(experts, config)
    before = RoutedExperts.from_config(experts, config, NumericsConfig(route_weight_before_w2=True))
    generator = torch.Generator().manual_seed(21)
    hidden = 3.0 * torch.randn(6, config.hidden_size, generator=generator)
    ids = torch.tensor([[0, 5], [2, 7], [1, 5], [3, 4], [0, 6], [2, 3]])
    weights = 0.2 + torch.rand(6, 2, generator=generator)
    out_before, out_after = before(2, hidden, ids, weights), after(2, hidden, ids, weights)
    scale = out_after.abs().max()
    assert (out_before - out_after).abs().max() <= 1e-6 * scale  # equal up to fp32 rounding
    assert not torch.equal(out_before, out_after)  # ... but the multiplication really moved
    # token 0 by hand, in the reference's order: Σ_k w2(g_k · silu(min(w1 x, L)) · clamp(w3 x, ±L))
    limit = config.swiglu_limit
    x = hidden[0].double()
    expected = torch.zeros(config.hidden_size, dtype=torch.float64)
    for k in range(2):
        w1, w2, w3 = (w.double() for w in experts[(2, int(ids[0, k]))])
        gate, up = (w1 @ x).clamp(max=limit), (w3 @ x).clamp(-limit, limit)
        expected += w2 @ (float(weights[0, k]) * F.silu(gate) * up)
    assert (out_before[0].double() - expected).abs().max() <= 1e-6 * scale


def test_route_weight_before_w2_split_and_expert_worker_paths(spec_tiny):
    config, hub_sd, tokens = spec_tiny
    numerics = NumericsConfig(route_weight_before_w2=True)
    monolithic = _build(config, hub_sd, numerics)
    _, experts = split_hub_state_dict(hub_sd, config)
    pairs = sorted(experts)
    holders = [RoutedExperts.from_config({p: experts[p] for p in pairs[k::2]}, config, numerics) for k in range(2)]
    split = ReferenceModel(monolithic.side, MultiHolderExperts(holders))
    logits = monolithic.forward_sequence(tokens)
    assert torch.equal(split.forward_sequence(tokens), logits)
    default_logits = _build(config, hub_sd, NumericsConfig()).forward_sequence(tokens)
    assert 0 < (logits - default_logits).abs().max() < 1e-5
    # the expert worker's grouped kernel follows the same switch, bit for bit
    grouping = pytest.importorskip("moemesh.services.expert.grouping")
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 5], [2, 7], [1, 5], [3, 4], [0, 6]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(3))
    expected = RoutedExperts.from_config(experts, config, numerics).per_expert_outputs(3, hidden, ids, weights)
    groups = grouping.group_by_expert(ids, None)
    got = grouping.slot_outputs(experts, 3, hidden, groups, weights, ids.shape[1], config.swiglu_limit, True)
    assert torch.equal(got, expected)


# ------------------------------------------------------------------------------------ KV FP8 QAT
def test_pow2_scale_rounds_up_and_keeps_exact_powers():
    amax = torch.tensor([448.0, 448.0 * 4, 448.0001, 224.0, 1.0, 300.0])
    assert pow2_scale_ceil(amax).tolist() == [1.0, 4.0, 2.0, 0.5, 2.0**-8, 1.0]


def test_fp8_quant_dequant_hand_computed_blocks():
    """Per-block scales: values that would round differently under a neighbour's scale, or without
    the amax floor, pin the block boundaries and the floor."""
    # one row of 130 channels = blocks of 64, 64 and 2 (a short last block)
    row = torch.zeros(130)
    row[0], row[1], row[2], row[3] = 448.0, 1.06, 3.3, -0.01  # block 0: amax 448 -> scale 1
    row[64], row[65], row[66] = 0.3, 0.0037, -0.52  # block 1: amax 0.52 -> scale 2^-9
    row[128], row[129] = 1e-9, -3e-9  # block 2: amax floored to 1e-4 -> scale 2^-22
    assert fp8_block_scales(row[None])[0].tolist() == [1.0, 2.0**-9, 2.0**-22]
    out = fp8_quant_dequant(row[None])[0]
    # e4m3 grid: subnormals m·2^-9 (m < 8); [1, 2) step 1/8; [2, 4) 1/4; [128, 256) 16; [256, 448] 32
    assert out[:4].tolist() == [448.0, 1.0, 3.25, -5 * 2.0**-9]  # -0.01 -> -5.12 · 2^-9
    # 0.3·2^9 = 153.6 -> 160; 0.0037·2^9 = 1.894 -> 1.875; -0.52·2^9 = -266.2 -> -256
    assert out[64:67].tolist() == [160 * 2.0**-9, 1.875 * 2.0**-9, -0.5]
    # 1e-9·2^22 = 0.0042 -> 2·2^-9 (subnormal); -3e-9·2^22 = -0.0126 -> -6·2^-9
    assert out[128:].tolist() == [2 * 2.0**-31, -6 * 2.0**-31]
    assert torch.count_nonzero(out[4:64]) == 0 and torch.count_nonzero(out[67:128]) == 0
    # under block 0's scale (one block of 128) 0.0037 would become the subnormal 2·2^-9
    assert fp8_quant_dequant(row[None], block_size=128)[0, 65].item() == 2 * 2.0**-9
    # without the floor block 2 would use scale 2^-37: 137.4 -> 144, -412.3 -> -416
    no_floor = fp8_quant_dequant(row[None, 128:], amax_floor=0.0)[0]
    assert no_floor.tolist() == [144 * 2.0**-37, -416 * 2.0**-37]
    # an all-zero row stays zero (the floor keeps the scale finite)
    assert torch.equal(fp8_quant_dequant(torch.zeros(1, 130)), torch.zeros(1, 130))


def test_fp8_quant_dequant_error_bound_idempotence_and_dtypes():
    x = torch.randn(16, 200, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 200)
    y = fp8_quant_dequant(x)
    scales = fp8_block_scales(x).repeat_interleave(64, dim=1)[:, :200]
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals, absolute <= 2^-10 · s for subnormals
    bound = torch.maximum(x.abs() * 2.0**-4, scales * 2.0**-10)
    assert ((y - x).abs() <= bound).all()
    assert (y != x).any()
    assert torch.equal(fp8_quant_dequant(y), y)
    # in bf16 the result is exact: the same numbers as the fp32 computation
    x16 = x.bfloat16()
    assert torch.equal(fp8_quant_dequant(x16), fp8_quant_dequant(x16.float()).bfloat16())
    # kv rows: only the first nope_dim channels change
    rows = kv_nope_fp8_qat(x, 88)
    assert torch.equal(rows[:, 88:], x[:, 88:]) and torch.equal(rows[:, :88], fp8_quant_dequant(x[:, :88]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_qat_captures_in_a_cuda_graph_and_replays_as_eager():
    """The serving step captures the KV and indexer quantisation with the rest of the layer: no host tensor may
    be copied to the device inside them, and a replay over new rows equals the eager result."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16, generator=generator)  # [R, C]
    fns = (lambda x: kv_nope_fp8_qat(x, 448), lambda x: indexer_fp8_qat(x), lambda x: pow2_scale_ceil(x.abs()))
    for fn in fns:
        fn(rows)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(rows)
        rows.copy_(torch.randn(8, 512, device="cuda", dtype=torch.bfloat16, generator=generator) * 7)
        graph.replay()
        assert torch.equal(out, fn(rows))


def _assert_e4m3_times_pow2_per_block(rows: torch.Tensor, nope_dim: int, what: str) -> None:
    """Every 64-block of rows[:, :nope_dim] is exactly (e4m3 value) · 2^k for one k (checked in Python math)."""
    assert rows.shape[0] > 0, what
    for row in rows.float():
        for begin in range(0, nope_dim, 64):
            block = row[begin: min(begin + 64, nope_dim)]
            amax = block.abs().max().item()
            if amax == 0.0:
                continue
            k = math.ceil(math.log2(amax / E4M3_MAX))
            mantissas = block * 2.0**-k
            assert mantissas.abs().max() <= E4M3_MAX, what
            assert torch.equal(mantissas.to(torch.float8_e4m3fn).float(), mantissas), what


def test_qat_rows_in_state_are_fp8_representable(qat_setup):
    config, _, _, (_, default_state), (_, qat_state) = qat_setup
    nope = config.nope_head_dim
    for layer, state in enumerate(qat_state.layers):
        window = state.window.live_tensors(config.sliding_window)["window"]
        _assert_e4m3_times_pow2_per_block(window, nope, f"layer {layer} window")
        if state.compressor is not None:
            _assert_e4m3_times_pow2_per_block(state.compressor.read_rows(), nope, f"layer {layer} rows")
    # the default path stores unquantized rows (so the check above can fail)
    default_window = default_state.layers[0].window.live_tensors(config.sliding_window)["window"]
    with pytest.raises(AssertionError):
        _assert_e4m3_times_pow2_per_block(default_window, nope, "default")


def test_qat_rows_are_fp8_representable_in_bfloat16(qat_setup):
    config, _, tokens, _, _ = qat_setup
    hub_sd, _ = random_hub_state_dict(config, seed=4321)
    model = _build(config, hub_sd, NumericsConfig(dtype="bfloat16", kv_fp8_qat=True))
    state = model.new_sequence()
    logits = model.forward(tokens[:40], [SequenceChunk(state, 40)])
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())
    for layer, layer_state in enumerate(state.layers):
        window = layer_state.window.live_tensors(config.sliding_window)["window"]
        assert window.dtype == torch.bfloat16
        _assert_e4m3_times_pow2_per_block(window, config.nope_head_dim, f"bf16 layer {layer} window")
        if layer_state.compressor is not None:
            _assert_e4m3_times_pow2_per_block(layer_state.compressor.read_rows(), config.nope_head_dim,
                                              f"bf16 layer {layer} rows")


def test_qat_changes_exactly_the_nope_channels_of_stored_rows(qat_setup):
    """Layer 0's inputs do not depend on QAT, so its stores must be the default ones, quantized on
    [:nope] only, and its indexer rows the default ones quantized whole (one scale per row); the rotary
    tail and the compressors' pending inputs are untouched."""
    config, _, _, (_, default_state), (_, qat_state) = qat_setup
    nope = config.nope_head_dim
    default_layer, qat_layer = default_state.layers[0], qat_state.layers[0]
    window = config.sliding_window
    default_window = default_layer.window.live_tensors(window)["window"]
    qat_window = qat_layer.window.live_tensors(window)["window"]
    assert torch.equal(qat_window, kv_nope_fp8_qat(default_window, nope))
    assert torch.equal(qat_window[:, nope:], default_window[:, nope:])
    assert not torch.equal(qat_window, default_window)
    default_rows, qat_rows = default_layer.compressor.read_rows(), qat_layer.compressor.read_rows()
    assert torch.equal(qat_rows, kv_nope_fp8_qat(default_rows, nope))
    assert not torch.equal(qat_rows, default_rows)
    for name, tensor in default_layer.compressor.live_tensors().items():
        if name != "rows":
            assert torch.equal(qat_layer.compressor.live_tensors()[name], tensor), name
    default_index_rows, qat_index_rows = default_layer.indexer.read_rows(), qat_layer.indexer.read_rows()
    assert torch.equal(qat_index_rows, indexer_fp8_qat(default_index_rows))
    assert not torch.equal(qat_index_rows, default_index_rows)
    for name, tensor in default_layer.indexer.live_tensors().items():
        if name != "rows":
            assert torch.equal(qat_layer.indexer.live_tensors()[name], tensor), name


def test_qat_logits_differ_slightly_from_default(qat_setup):
    _, _, _, (default_logits, _), (qat_logits, _) = qat_setup
    difference = (qat_logits - default_logits).abs()
    assert difference.max() > 1e-4  # really changed
    # ... by a small amount (the rounded indexer rows also flip some of the tiny model's top-2 picks at near ties)
    assert difference.mean() < 0.15 * default_logits.abs().mean()
    agreement = (qat_logits.argmax(-1) == default_logits.argmax(-1)).float().mean()
    assert agreement > 0.7


def _chunk_sizes(seed: int, total: int) -> list[int]:
    rng, sizes = random.Random(seed), []
    while sum(sizes) < total:
        sizes.append(min(rng.choice([1, 1, 2, 3, 7, 13]), total - sum(sizes)))
    return sizes


def _assert_states_match_up_to_e4m3_flips(expected_state, state) -> None:
    """Same tensors; all but a few elements within TOLERANCE, the rest within one e4m3 step."""
    expected, got = expected_state.live_tensors(), state.live_tensors()
    assert set(expected) == set(got)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        if tensor.numel() == 0:
            continue
        difference = (got[name] - tensor).abs()
        assert (difference > TOLERANCE).float().mean() <= MAX_E4M3_FLIP_FRACTION, name
        assert difference.max() <= 2.0**-3 * tensor.abs().max(), name


def test_qat_chunked_prefill_and_decode_equal_full_forward(qat_setup):
    config, qat, tokens, _, (full_logits, full_state) = qat_setup
    for seed in range(2):
        state, outputs, pos = qat.new_sequence(), [], 0
        for size in _chunk_sizes(seed, SEQ_LEN):
            outputs.append(qat.forward(tokens[pos:pos + size], [SequenceChunk(state, size)]))
            pos += size
        assert (torch.cat(outputs) - full_logits).abs().max() < QAT_LOGITS_TOLERANCE
        _assert_states_match_up_to_e4m3_flips(full_state, state)


def test_qat_rollback_then_redecode_equals_plain_decode(qat_setup):
    _, qat, tokens, _, (full_logits, _) = qat_setup
    state = qat.new_sequence()
    qat.forward(tokens[:40], [SequenceChunk(state, 40)])
    qat.forward(tokens[40:45], [SequenceChunk(state, 5)])  # "drafts", then rejected
    state.rollback(5)
    replay = torch.cat([qat.forward(tokens[p:p + 1], [SequenceChunk(state, 1)]) for p in range(40, 48)])
    assert (replay - full_logits[40:48]).abs().max() < QAT_LOGITS_TOLERANCE
