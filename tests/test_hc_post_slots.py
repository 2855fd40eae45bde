"""The routed experts' slot sum inside hc_post's launch (`mhc_streams._hc_post_kernel` with Y_SLOTS, `hyper.hc_post`
with per-slot y [T, K, D]) against the launches it replaces (`sum_slots_in_order`, then hc_post), bit for bit;
the layer loops that hand an in-process holder's per-slot outputs to ffn_post (`moe.routed_answer`,
`MoEDispatcher.finish`, `LayerSegments.set_routed`).

CPU: the kernels under TRITON_INTERPRET=1 at small sizes, in this process when it runs with the variable set,
else in one child pytest process that sets it; sm_90 compilation of the new variant (Triton's ptxas). CUDA:
V4-Flash sizes (skip without a GPU).
Legend: T tokens, K top-k slots, N hc streams, D hidden, M next hc_pre's mix rows.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from interpret_support import INTERPRETING, cuda, interpreted, run_interpreted_tests  # noqa: E402

from moemesh.common.kernels.moe_layout import sum_slots_in_order, sum_slots_in_order_torch  # noqa: E402

TOKEN_COUNTS = (1, 3, 8, 64)
TOP_KS = (1, 2, 3, 4, 6)  # the tiny configs' K (2, 3, 4) and V4-Flash's 6


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def post_inputs(num_tokens: int, top_k: int, num_streams: int, hidden: int, dtype: torch.dtype, seed: int,
                device: str = "cpu", num_mix: int = 24) -> dict:
    """Slots [T, K, D] with masked (all-zero) and unheld slots, shared addend [T, D], streams h [T, N, D],
    post [T, N], comb [T, N, N], next_fn [M, N·D] fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    slots = torch.randn(num_tokens, top_k, hidden, generator=gen, device=device).to(dtype)  # [T, K, D]
    masked = torch.rand(num_tokens, top_k, generator=gen, device=device) < 0.3  # slots no expert computed here
    slots = slots * ~masked[..., None]
    slots[0, -1] = -slots[0, -1]  # a -0 row among the zeros
    return {
        "slots": slots,
        "h": torch.randn(num_tokens, num_streams, hidden, generator=gen, device=device).to(dtype),
        "post": 2 * torch.rand(num_tokens, num_streams, generator=gen, device=device),
        "comb": torch.rand(num_tokens, num_streams, num_streams, generator=gen, device=device) / num_streams,
        "shared": torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype),
        "next_fn": torch.randn(num_mix, num_streams * hidden, generator=gen, device=device) / hidden,
    }


# ------------------------------------------------------------------------------ CPU, no kernels
def test_torch_hc_post_sums_the_slots_first():
    from moemesh.common.model import hyper

    for dtype in (torch.bfloat16, torch.float32):
        x = post_inputs(3, 4, 4, 40, dtype, seed=1)
        ours = hyper.hc_post(x["slots"], x["h"], x["post"], x["comb"], y_addend=x["shared"])
        summed = hyper.hc_post(sum_slots_in_order_torch(x["slots"]), x["h"], x["post"], x["comb"], y_addend=x["shared"])
        assert torch.equal(bits(ours), bits(summed))


def test_routed_answer_is_a_holders_slots_and_any_other_functions_sum():
    from moemesh.common.model.moe import MultiHolderExperts, RoutedExperts, routed_answer

    gen = torch.Generator().manual_seed(2)
    weights = {(0, e): (torch.randn(8, 16, generator=gen), torch.randn(16, 8, generator=gen),
                        torch.randn(8, 16, generator=gen)) for e in range(4)}
    holder = RoutedExperts(weights, 10.0)
    x, ids = torch.randn(3, 16, generator=gen), torch.tensor([[0, 2], [1, 3], [0, 1]])
    route = torch.rand(3, 2, generator=gen)
    per_slot = routed_answer(holder, 0, x, ids, route)
    assert per_slot.shape == (3, 2, 16)
    assert torch.equal(sum_slots_in_order(per_slot), holder(0, x, ids, route))
    summed = routed_answer(MultiHolderExperts([holder]), 0, x, ids, route)
    assert summed.shape == (3, 16) and torch.equal(summed, holder(0, x, ids, route))


def test_set_routed_sums_slots_into_a_static_buffer_and_keeps_them_otherwise():
    from moemesh.services.attention.model_runner import LayerSegments

    class Side:
        class config:
            num_hidden_layers = 1

    slots = torch.randn(2, 3, 8).bfloat16()
    live = LayerSegments(Side(), None, torch.zeros(2, dtype=torch.long))
    live.set_routed(slots)
    assert live._routed is slots
    static = LayerSegments(Side(), None, torch.zeros(4, dtype=torch.long), torch.zeros(4, 8).bfloat16())
    static.set_routed(slots)
    assert torch.equal(static.routed_in[:2], sum_slots_in_order_torch(slots)) and not static.routed_in[2:].any()


# ------------------------------------------------------------------------------ interpreted kernels
def test_interpreted_cases_pass_in_a_child_process():
    run_interpreted_tests(__file__, keyword="interpreted_", timeout_s=1800, stop_first=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_interpreted_hc_post_with_slots_equals_slot_sum_then_hc_post(num_tokens, dtype):
    """One launch (slots summed inside, shared added, next hc_pre's partials) = `_sum_slots_kernel` then
    `_hc_post_kernel`, bit for bit: streams and partials; also without the addend, without the partials, and
    over two D slices with a ragged last one (D = 40, 32 columns per program)."""
    from moemesh.common.kernels import mhc_streams
    from moemesh.common.kernels.route_layout import sum_slots_kernel

    for top_k in TOP_KS if num_tokens < 64 else (2, 6):  # 64 tokens: the interpreter's slowest case
        x = post_inputs(num_tokens, top_k, 4, 40, dtype, seed=10 * num_tokens + top_k)
        summed = sum_slots_kernel(x["slots"])  # [T, D]
        assert torch.equal(bits(summed), bits(sum_slots_in_order_torch(x["slots"])))
        with_addend = num_tokens > 1 or top_k % 2 == 0  # T = 1, odd K: without the shared addend
        addend = x["shared"] if with_addend else None
        next_fn = x["next_fn"] if top_k != 4 else None  # K = 4: no next hc_pre (the last layer)
        ours, ours_mix = mhc_streams.hc_post_with_mix(x["slots"], x["h"], x["post"], x["comb"], next_fn, block_d=32,
                                              y_addend=addend)
        old, old_mix = mhc_streams.hc_post_with_mix(summed, x["h"], x["post"], x["comb"], next_fn, block_d=32,
                                            y_addend=addend)
        assert torch.equal(bits(ours), bits(old)), top_k
        fused_mix = next_fn is not None and num_tokens <= mhc_streams.MAX_FUSED_MIX_TOKENS
        assert (ours_mix is None) == (old_mix is None) == (not fused_mix)
        if ours_mix is not None:
            assert torch.equal(ours_mix.mix_part, old_mix.mix_part) and torch.equal(ours_mix.sq_part, old_mix.sq_part)


@interpreted
def test_interpreted_ffn_post_with_slots_is_one_launch_and_the_same_bits(monkeypatch):
    """`AttentionSide.ffn_post` given a quantized holder's per-slot outputs: the hc_post launch only, where the
    summed answer took the slot sum's launch first; the same streams."""
    from test_route_layout import _counted_launches, random_holder, random_routing

    from moemesh.common.kernels.glue import INTERPRET_ON_CPU_ENV
    from moemesh.common.model.config import AttentionKind, NumericsConfig
    from moemesh.common.model.moe import routed_answer
    from moemesh.common.model.random_init import random_attention_side, tiny_flash_like_config

    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    config = tiny_flash_like_config([AttentionKind.WINDOW] * 2, kernel_friendly=True)
    side = random_attention_side(config, NumericsConfig(dtype="bfloat16"), "cpu", seed=3)
    experts = random_holder(seed=4)  # K = 3 of 10 routed experts, 6 held
    num_tokens = 3
    x, ids, route = random_routing(num_tokens, seed=5)
    ids = torch.tensor([0, 2, 3, 5, 6, 9])[ids % 6]  # held experts only
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(num_tokens, config.hc_mult, config.hidden_size, generator=gen).bfloat16()
    post = 2 * torch.rand(num_tokens, config.hc_mult, generator=gen)
    comb = torch.rand(num_tokens, config.hc_mult, config.hc_mult, generator=gen)
    shared = torch.randn(num_tokens, config.hidden_size, generator=gen).bfloat16()
    per_slot = routed_answer(experts, 0, x, ids, route)  # [T, K, D]
    assert per_slot.shape == (num_tokens, 3, config.hidden_size)
    with _counted_launches() as (launches, _):
        ours = side.ffn_post(0, per_slot, h, post, comb, shared=shared)
    assert launches == ["_hc_post_kernel"], launches
    with _counted_launches() as (launches, _):
        old = side.ffn_post(0, sum_slots_in_order(per_slot), h, post, comb, shared=shared)
    assert launches == ["_sum_slots_kernel", "_hc_post_kernel"], launches
    assert torch.equal(bits(ours), bits(old))


# ------------------------------------------------------------------------------ sm_90 compilation
def _ptxas_present() -> bool:
    from moemesh.bench.kernel_sass import _tool

    return os.path.exists(_tool("ptxas"))


def _compile_post_sm90(signature: dict, constexprs: dict) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moemesh.bench.kernel_sass import summarise
    from moemesh.common.kernels.mhc_streams import _hc_post_kernel

    compiled = compile(ASTSource(_hc_post_kernel, {**signature, **{k: "constexpr" for k in constexprs}},
                                 constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return summarise(compiled)


@pytest.mark.skipif(INTERPRETING or not _ptxas_present(), reason="compiles for sm_90 (not interpreted, ptxas)")
def test_hc_post_with_slots_compiles_for_sm90_and_spills_no_more_than_without():
    """Without the next hc_pre's partials: no spill. With them (BM 32 × 256 products per program) the kernel
    already keeps 48 bytes of stack without slots; the slot sum adds at most one 8-byte slot."""
    signature = {"y_ptr": "*bf16", "h_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16",
                 "hidden": "i32", "addend_ptr": "*bf16"}
    plain = _compile_post_sm90(signature, {"N": 4, "NP": 4, "BLOCK_D": 256, "Y_SLOTS": 6})
    assert plain["stack_bytes"] == 0, plain
    signature.update(next_fn_ptr="*fp32", mix_part_ptr="*fp32", sq_part_ptr="*fp32", num_mix="i32")
    constexprs = {"N": 4, "NP": 4, "BLOCK_D": 256, "BLOCK_M": 32}
    with_slots = _compile_post_sm90(signature, {**constexprs, "Y_SLOTS": 6})["stack_bytes"]
    assert with_slots <= _compile_post_sm90(signature, constexprs)["stack_bytes"] + 8


# ------------------------------------------------------------------------------ CUDA, V4-Flash size
@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 2048])
def test_cuda_hc_post_with_slots_equals_slot_sum_then_hc_post_at_flash_size(num_tokens):
    from moemesh.common.model import hyper

    x = post_inputs(num_tokens, 6, 4, 4096, torch.bfloat16, seed=num_tokens, device="cuda")
    ours, ours_mix = hyper.hc_post_with_mix(x["slots"], x["h"], x["post"], x["comb"], x["next_fn"],
                                            y_addend=x["shared"])
    old, old_mix = hyper.hc_post_with_mix(sum_slots_in_order(x["slots"]), x["h"], x["post"], x["comb"], x["next_fn"],
                                          y_addend=x["shared"])
    assert torch.equal(bits(ours), bits(old))
    assert (ours_mix is None) == (old_mix is None)
    if ours_mix is not None:
        assert torch.equal(ours_mix.mix_part, old_mix.mix_part) and torch.equal(ours_mix.sq_part, old_mix.sq_part)
