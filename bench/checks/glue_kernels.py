"""Fused glue kernels (mHC, RMS norm, RoPE) against their torch references on fresh random inputs.

`python -m moemesh.bench.checks.glue_kernels --suite interpret [--only mhc|norm]` runs the small cases
(meant for `TRITON_INTERPRET=1` on CPU: kernels are called directly on CPU tensors) and prints one
JSON object per case; `--suite cuda` the V4-Flash sizes through the model's dispatching functions
(Triton by default, torch under `forced_torch_glue`).

Error measure: ‖out − ref‖ / ‖ref‖ per output, the largest one reported. fp32 cases only differ by
summation order (≤ 1e-5). bf16 outputs reproduce the reference's roundings, so on the GPU they
differ by rare one-ulp flips (bound 1e-2, the same as quantized_kernels.BF16_TOLERANCE); the interpreter
truncates instead of rounding when it casts to bf16, so its bf16 cases also get 1e-2.
Sinkhorn: the kernel's comb must be as doubly stochastic as the reference's (row and column sums'
largest distance from 1 within the reference's + 1e-5).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2
STOCHASTIC_SLACK = 1e-5
HC_EPS = NORM_EPS = 1e-6


@dataclass(frozen=True)
class GlueCheck:
    case_id: str
    relative_error: float
    tolerance: float
    all_finite: bool
    fp32_error: float | None = None  # hc_pre's fp32 outputs (post, comb), bound FP32_TOLERANCE
    stochastic_error: float | None = None  # kernel comb's max |row/col sum − 1|
    stochastic_bound: float | None = None  # the reference's + slack
    fp64_errors: dict[str, float] | None = None  # {"kernel": .., "torch": ..} against an fp64 oracle

    @property
    def passed(self) -> bool:
        fp32_ok = self.fp32_error is None or self.fp32_error <= FP32_TOLERANCE
        stochastic_ok = self.stochastic_error is None or self.stochastic_error <= self.stochastic_bound
        return self.all_finite and self.relative_error <= self.tolerance and fp32_ok and stochastic_ok


def _relative_error(outs, refs) -> tuple[float, bool]:
    worst, finite = 0.0, True
    for out, ref in zip(outs, refs, strict=True):
        out64, ref64 = out.double(), ref.double()
        finite = finite and bool(torch.isfinite(out64).all())
        worst = max(worst, float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)))
    return worst, finite


def _stochastic_error(comb: torch.Tensor) -> float:
    return float(max((comb.sum(-1) - 1).abs().max(), (comb.sum(-2) - 1).abs().max()))


def _poison(device: str, num_bytes: int = 1 << 28) -> None:
    """Fill freed cached memory with NaN so an unwritten output element shows (CUDA allocator reuse)."""
    if device == "cuda":
        torch.full((num_bytes // 4,), float("nan"), device=device)


def _tolerance(dtype: torch.dtype) -> float:
    return FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE


def _mhc_inputs(num_tokens, num_streams, hidden, num_mix, dtype, device, generator):
    h = torch.randn(num_tokens, num_streams, hidden, generator=generator, device=device).to(dtype)
    # mix entries ~ N(0, 4): the logits stay where sigmoid and softmax are not saturated, like trained weights
    num_cols = num_streams * hidden
    fn = torch.randn(num_mix, num_cols, generator=generator, device=device) * 2 / num_cols**0.5
    base = torch.randn(num_mix, generator=generator, device=device)
    scale = torch.rand(3, generator=generator, device=device) + 0.5
    return h, fn, base, scale


def check_hc_pre(case_id, num_tokens, num_streams, hidden, num_iters, dtype, device, kernel_fn, config=None,
                 normed: bool = False):
    """normed: kernel_fn (hyper.hc_pre or mhc.hc_pre) is given out_norm = (norm_weight, eps)."""
    from moemesh.common.kernels.glue import forced_torch_glue
    from moemesh.common.model import hyper, linear

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    args = _mhc_inputs(num_tokens, num_streams, hidden, (2 + num_streams) * num_streams, dtype, device, generator)
    norm_weight = torch.rand(hidden, generator=generator, device=device) + 0.5
    with forced_torch_glue():
        ref = hyper.hc_pre(*args, num_iters, HC_EPS, NORM_EPS)
        if normed:
            ref = (linear.rms_norm(ref[0], norm_weight, NORM_EPS), *ref[1:])
    _poison(device)
    kwargs = {"config": config} if config is not None else {}
    if normed:
        out = kernel_fn(*args, num_iters, HC_EPS, NORM_EPS, out_norm=(norm_weight, NORM_EPS), **kwargs)
    else:
        out = kernel_fn(*args, num_iters, HC_EPS, NORM_EPS, **kwargs)
    error, finite = _relative_error(out[:1], ref[:1])
    fp32_error, fp32_finite = _relative_error(out[1:], ref[1:])
    return GlueCheck(case_id, error, _tolerance(dtype), finite and fp32_finite, fp32_error,
                     _stochastic_error(out[2]), _stochastic_error(ref[2]) + STOCHASTIC_SLACK)


def check_hc_post(case_id, num_tokens, num_streams, hidden, dtype, device, kernel_fn, with_addend: bool = False,
                  **kwargs):
    from moemesh.common.kernels.glue import forced_torch_glue
    from moemesh.common.model import hyper

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    h, fn, base, scale = _mhc_inputs(num_tokens, num_streams, hidden, (2 + num_streams) * num_streams, dtype,
                                     device, generator)
    y = torch.randn(num_tokens, hidden, generator=generator, device=device).to(dtype)
    addend = torch.randn(num_tokens, hidden, generator=generator, device=device).to(dtype) if with_addend else None
    with forced_torch_glue():
        _, post, comb = hyper.hc_pre(h, fn, base, scale, 20, HC_EPS, NORM_EPS)
        ref = hyper.hc_post(y, h, post, comb, y_addend=addend)
    _poison(device)
    out = kernel_fn(y, h, post, comb, **({"y_addend": addend} if with_addend else {}), **kwargs)
    error, finite = _relative_error([out], [ref])
    if with_addend:
        y = y + addend  # the block output both computed from
    # fp64 oracle from the same (rounded) coefficients: which of the two is nearer the exact sum
    post64, comb64 = post.to(dtype).double(), comb.to(dtype).double()
    exact = post64.unsqueeze(-1) * y.double().unsqueeze(-2) + torch.matmul(comb64.transpose(-1, -2), h.double())
    fp64_errors = {"kernel": _relative_error([out], [exact])[0], "torch": _relative_error([ref], [exact])[0]}
    return GlueCheck(case_id, error, _tolerance(dtype), finite, fp64_errors=fp64_errors)


def _check_next_hc_pre(case_id, streams, partials, site, norm_weight, dtype, same_streams: bool) -> GlueCheck:
    """The hc_pre (fn, base, scale) = site, with its norm, over streams written by a launch that may have done its
    mix (`partials`: there up to MAX_FUSED_MIX_TOKENS tokens, None above) against the torch hc_pre of those
    streams, as `check_hc_pre` measures it; passes only with same_streams."""
    from moemesh.common.kernels import mhc, mhc_streams
    from moemesh.common.kernels.glue import forced_torch_glue
    from moemesh.common.model import hyper, linear

    fn, base, scale = site
    if streams.shape[0] <= mhc_streams.MAX_FUSED_MIX_TOKENS:
        used = partials is not None and partials.serves(streams, fn)
    else:  # more tokens: the writer alone, the hc_pre its own two launches
        used = partials is None
    out = mhc.hc_pre(streams, fn, base, scale, 20, HC_EPS, NORM_EPS, out_norm=(norm_weight, NORM_EPS),
                     partials=partials)
    with forced_torch_glue():
        ref = hyper.hc_pre(streams, fn, base, scale, 20, HC_EPS, NORM_EPS)
        ref = (linear.rms_norm(ref[0], norm_weight, NORM_EPS), *ref[1:])
    error, finite = _relative_error(out[:1], ref[:1])
    fp32_error, fp32_finite = _relative_error(out[1:], ref[1:])
    return GlueCheck(case_id, error, _tolerance(dtype), finite and fp32_finite and same_streams and used, fp32_error,
                     _stochastic_error(out[2]), _stochastic_error(ref[2]) + STOCHASTIC_SLACK)


def check_hc_post_mix(case_id, num_tokens, num_streams, hidden, dtype, device, block_d=None):
    """hc_post doing the next hc_pre's mix GEMV in its launch: its streams equal a plain hc_post's bit for bit,
    and the hc_pre (with its norm) that takes the partials matches the torch hc_pre of those streams as
    `check_hc_pre` measures it."""
    from moemesh.common.kernels import mhc_streams
    from moemesh.common.kernels.glue import forced_torch_glue
    from moemesh.common.model import hyper

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    num_mix = (2 + num_streams) * num_streams
    h, fn, base, scale = _mhc_inputs(num_tokens, num_streams, hidden, num_mix, dtype, device, generator)
    _, next_fn, next_base, next_scale = _mhc_inputs(num_tokens, num_streams, hidden, num_mix, dtype, device, generator)
    y = torch.randn(num_tokens, hidden, generator=generator, device=device).to(dtype)
    norm_weight = torch.rand(hidden, generator=generator, device=device) + 0.5
    with forced_torch_glue():
        _, post, comb = hyper.hc_pre(h, fn, base, scale, 20, HC_EPS, NORM_EPS)
    _poison(device)
    streams, partials = mhc_streams.hc_post_with_mix(y, h, post, comb, next_fn, block_d=block_d)
    same_streams = torch.equal(streams, mhc_streams.hc_post(y, h, post, comb, block_d=block_d))
    return _check_next_hc_pre(case_id, streams, partials, (next_fn, next_base, next_scale), norm_weight, dtype,
                              same_streams)


def check_embed_streams(case_id, num_tokens, num_streams, hidden, dtype, device, block_d=None):
    """The embedding doing the first hc_pre's mix GEMV in its launch: its streams equal the torch embedding's
    (N copies of each row, cast to dtype) bit for bit, and the hc_pre (with its norm) that takes the partials
    matches the torch hc_pre of those streams as `check_hc_pre` measures it."""
    from moemesh.common.kernels import mhc_streams
    from moemesh.common.kernels.glue import forced_torch_glue
    from moemesh.common.model import hyper

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    num_mix = (2 + num_streams) * num_streams
    _, fn, base, scale = _mhc_inputs(num_tokens, num_streams, hidden, num_mix, dtype, device, generator)
    table = torch.randn(97, hidden, generator=generator, device=device).to(dtype)  # a table held in the dtype
    token_ids = torch.randint(0, 97, (num_tokens,), generator=generator, device=device)
    norm_weight = torch.rand(hidden, generator=generator, device=device) + 0.5
    _poison(device)
    streams, partials = mhc_streams.embed_streams(token_ids, table, num_streams, dtype, fn, block_d=block_d)
    with forced_torch_glue():
        want_streams, _ = hyper.embed_streams(token_ids, table, num_streams, dtype)
    same_streams = torch.equal(streams, want_streams)
    return _check_next_hc_pre(case_id, streams, partials, (fn, base, scale), norm_weight, dtype, same_streams)


def check_hc_head(case_id, num_tokens, num_streams, hidden, dtype, device, kernel_fn, normed: bool = False,
                  **kwargs):
    """normed: kernel_fn (hyper.hc_head or mhc.hc_head) is given out_norm = (norm_weight, eps)."""
    from moemesh.common.kernels.glue import forced_torch_glue
    from moemesh.common.model import hyper, linear

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    h, fn, base, _ = _mhc_inputs(num_tokens, num_streams, hidden, num_streams, dtype, device, generator)
    scale = torch.rand(1, generator=generator, device=device) + 0.5
    norm_weight = torch.rand(hidden, generator=generator, device=device) + 0.5
    with forced_torch_glue():
        ref = hyper.hc_head(h, fn, base, scale, HC_EPS, NORM_EPS)
        if normed:
            ref = linear.rms_norm(ref, norm_weight, NORM_EPS)
    _poison(device)
    if normed:
        out = kernel_fn(h, fn, base, scale, HC_EPS, NORM_EPS, out_norm=(norm_weight, NORM_EPS), **kwargs)
    else:
        out = kernel_fn(h, fn, base, scale, HC_EPS, NORM_EPS, **kwargs)
    error, finite = _relative_error([out], [ref])
    return GlueCheck(case_id, error, _tolerance(dtype), finite)


def check_norm_rope(case_id, op: str, shape, rope_half, dtype, device, kernels):
    """op: rms | unweighted | rope | inverse | q (unweighted + rope) | kv (weighted + rope)."""
    from moemesh.common.kernels.glue import forced_torch_glue
    from moemesh.common.model import linear, rope

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    x = (torch.randn(*shape, generator=generator, device=device) * 3).to(dtype)
    weight = torch.rand(shape[-1], generator=generator, device=device) + 0.5
    angles = torch.randn(shape[0], rope_half, generator=generator, device=device) * 100
    cos, sin = angles.cos(), angles.sin()
    calls = {
        "rms": (lambda m: m.rms_norm(x, weight, NORM_EPS)),
        "unweighted": (lambda m: m.unweighted_rms_norm(x, NORM_EPS)),
        "rope": (lambda m: m.apply_rope(x, cos, sin)),
        "inverse": (lambda m: m.inverse_rope(x, cos, sin)),
        "q": (lambda m: m.rms_norm_rope(x, cos, sin, NORM_EPS)),
        "kv": (lambda m: m.rms_norm_rope(x, cos, sin, NORM_EPS, weight)),
    }

    class _Model:  # the torch functions, under one namespace
        rms_norm = staticmethod(linear.rms_norm)
        unweighted_rms_norm = staticmethod(linear.unweighted_rms_norm)
        apply_rope = staticmethod(rope.apply_rope)
        inverse_rope = staticmethod(rope.inverse_rope)
        rms_norm_rope = staticmethod(rope.rms_norm_rope)

    with forced_torch_glue():
        ref = calls[op](_Model)
    _poison(device)
    out = calls[op](kernels)
    error, finite = _relative_error([out], [ref])
    return GlueCheck(case_id, error, _tolerance(dtype), finite)


class _DirectNormRope:
    """The norm_rope kernels under the model functions' names (the interpreter runs them on CPU tensors)."""

    def __init__(self):
        from moemesh.common.kernels import norm_rope

        self.m = norm_rope

    def rms_norm(self, x, weight, eps):
        return self.m.rms_norm(x, weight, eps)

    def unweighted_rms_norm(self, x, eps):
        return self.m.unweighted_rms_norm(x, eps)

    def apply_rope(self, x, cos, sin):
        return self.m.apply_rope(x, cos, sin)

    def inverse_rope(self, x, cos, sin):
        return self.m.apply_rope(x, cos, sin, inverse=True)

    def rms_norm_rope(self, x, cos, sin, eps, weight=None):
        kind = self.m.NormKind.UNWEIGHTED if weight is None else self.m.NormKind.WEIGHTED
        return self.m.norm_rope(x, norm=kind, eps=eps, weight=weight, cos=cos, sin=sin)


Case = tuple[str, Callable[[], GlueCheck]]


def interpret_cases(only: str | None = None) -> list[Case]:
    from moemesh.common.kernels import mhc, mhc_streams

    cpu, f32, bf16 = "cpu", torch.float32, torch.bfloat16
    small = mhc.MixConfig(block_t=16, block_k=16, num_splits=4, block_d=32)
    odd = mhc.MixConfig(block_t=16, block_k=32, num_splits=3, block_d=32)
    split_bf16 = mhc.MixConfig(block_t=16, block_k=16, num_splits=2, block_d=32, precision="bf16x3")
    gemv = mhc.MixConfig(block_t=1, block_k=32, num_splits=3, block_d=32, finish_num_warps=1)
    approx = mhc.MixConfig(block_t=16, block_k=16, num_splits=4, block_d=32, approx_division=True)
    mhc_cases: list[Case] = [
        ("hc_pre_n4", lambda: check_hc_pre("hc_pre_n4", 3, 4, 64, 20, f32, cpu, mhc.hc_pre, small)),
        ("hc_pre_n2_ragged", lambda: check_hc_pre("hc_pre_n2_ragged", 17, 2, 48, 3, f32, cpu, mhc.hc_pre, odd)),
        ("hc_pre_n3_padded", lambda: check_hc_pre("hc_pre_n3_padded", 2, 3, 32, 5, f32, cpu, mhc.hc_pre, small)),
        ("hc_pre_bf16", lambda: check_hc_pre("hc_pre_bf16", 4, 4, 32, 20, bf16, cpu, mhc.hc_pre, small)),
        ("hc_pre_gemv", lambda: check_hc_pre("hc_pre_gemv", 3, 4, 48, 20, f32, cpu, mhc.hc_pre, gemv)),
        ("hc_pre_approx_div", lambda: check_hc_pre("hc_pre_approx_div", 3, 4, 64, 20, f32, cpu, mhc.hc_pre,
                                                   approx)),
        ("hc_head_gemv", lambda: check_hc_head("hc_head_gemv", 2, 4, 48, f32, cpu, mhc.hc_head, config=gemv)),
        ("hc_pre_bf16x3", lambda: check_hc_pre("hc_pre_bf16x3", 4, 4, 32, 20, bf16, cpu, mhc.hc_pre, split_bf16)),
        ("hc_post_n4", lambda: check_hc_post("hc_post_n4", 3, 4, 80, f32, cpu, mhc_streams.hc_post, block_d=32)),
        ("hc_post_n3", lambda: check_hc_post("hc_post_n3", 2, 3, 32, f32, cpu, mhc_streams.hc_post, block_d=16)),
        ("hc_post_bf16", lambda: check_hc_post("hc_post_bf16", 3, 4, 64, bf16, cpu, mhc_streams.hc_post, block_d=32)),
        ("hc_post_n4_addend", lambda: check_hc_post("hc_post_n4_addend", 3, 4, 80, f32, cpu, mhc_streams.hc_post,
                                                    with_addend=True, block_d=32)),
        ("hc_head_n4", lambda: check_hc_head("hc_head_n4", 5, 4, 48, f32, cpu, mhc.hc_head, config=odd)),
        ("hc_pre_normed_d48", lambda: check_hc_pre("hc_pre_normed_d48", 3, 4, 48, 20, f32, cpu, mhc.hc_pre, odd,
                                                   normed=True)),
        ("hc_head_normed_bf16", lambda: check_hc_head("hc_head_normed_bf16", 2, 4, 64, bf16, cpu, mhc.hc_head,
                                                      normed=True, config=small)),
        ("hc_post_mix_n4", lambda: check_hc_post_mix("hc_post_mix_n4", 3, 4, 80, f32, cpu, block_d=32)),
        ("hc_post_mix_bf16", lambda: check_hc_post_mix("hc_post_mix_bf16", 2, 4, 64, bf16, cpu, block_d=16)),
        ("embed_mix_n4", lambda: check_embed_streams("embed_mix_n4", 3, 4, 80, f32, cpu, block_d=32)),
        ("embed_mix_bf16", lambda: check_embed_streams("embed_mix_bf16", 2, 4, 64, bf16, cpu, block_d=16)),
    ]
    direct = _DirectNormRope()
    norm_specs = [  # case id, op, shape, rope pairs, dtype
        ("rms_f32", "rms", (5, 40), 0, f32), ("unweighted_f32", "unweighted", (2, 3, 32), 0, f32),
        ("rope_f32", "rope", (3, 4, 32), 4, f32), ("inverse_f32", "inverse", (3, 4, 32), 8, f32),
        ("q_f32", "q", (2, 4, 32), 8, f32), ("kv_f32", "kv", (3, 40), 4, f32),
        ("q_bf16", "q", (2, 3, 64), 8, bf16), ("kv_bf16", "kv", (3, 64), 4, bf16),
    ]
    norm_cases: list[Case] = [
        (case_id, lambda c=case_id, o=op, s=shape, r=half, d=dtype: check_norm_rope(c, o, s, r, d, cpu, direct))
        for case_id, op, shape, half, dtype in norm_specs
    ]
    return (mhc_cases if only != "norm" else []) + (norm_cases if only != "mhc" else [])


def cuda_cases(only: str | None = None) -> list[Case]:
    """V4-Flash sizes (N 4, D 4096, 20 iterations; 64 heads × 512, rope 64; q_lora 1024) through the model."""
    from moemesh.common.model import hyper, linear, rope

    class _Model:
        rms_norm = staticmethod(linear.rms_norm)
        unweighted_rms_norm = staticmethod(linear.unweighted_rms_norm)
        apply_rope = staticmethod(rope.apply_rope)
        inverse_rope = staticmethod(rope.inverse_rope)
        rms_norm_rope = staticmethod(rope.rms_norm_rope)

    cuda, f32, bf16 = "cuda", torch.float32, torch.bfloat16
    mhc_cases: list[Case] = []
    for num_tokens in (1, 8, 64, 2048):
        case = f"hc_pre_t{num_tokens}"
        mhc_cases.append((case, lambda c=case, t=num_tokens: check_hc_pre(c, t, 4, 4096, 20, bf16, cuda, hyper.hc_pre)))
    from moemesh.common.kernels import mhc

    def alternative(num_tokens: int, **changes) -> mhc.MixConfig:  # built when the case runs: it asks the device
        return replace(mhc.choose_mix_config(num_tokens, 4 * 4096, torch.device("cuda"), bf16), **changes)

    alternatives = {  # the kernels the defaults do not pick at these sizes
        "hc_pre_dot_ieee_t1": (1, dict(block_t=16, precision="ieee")),
        "hc_pre_dot_bf16x3_t8": (8, dict(block_t=16, precision="bf16x3")),
        "hc_pre_dot_ieee_t2048": (2048, dict(block_t=64, precision="ieee")),
        "hc_pre_tf32x3_t2048": (2048, dict(block_t=64, block_k=32, num_warps=4, precision="tf32x3")),
        "hc_pre_finish_w4_t1": (1, dict(finish_num_warps=4)),
        "hc_pre_approx_div_t1": (1, dict(approx_division=True)),
        "hc_pre_approx_div_t2048": (2048, dict(approx_division=True)),
    }
    for case, (num_tokens, changes) in alternatives.items():
        mhc_cases.append((case, lambda c=case, t=num_tokens, k=changes: check_hc_pre(
            c, t, 4, 4096, 20, bf16, cuda, mhc.hc_pre, alternative(t, **k))))
    mhc_cases.append(("hc_pre_f32_t8", lambda: check_hc_pre("hc_pre_f32_t8", 8, 4, 4096, 20, f32, cuda,
                                                           hyper.hc_pre)))
    for num_tokens in (1, 2048):
        case = f"hc_pre_normed_t{num_tokens}"
        mhc_cases.append((case, lambda c=case, t=num_tokens: check_hc_pre(c, t, 4, 4096, 20, bf16, cuda,
                                                                          hyper.hc_pre, normed=True)))
        case = f"hc_head_normed_t{num_tokens}"
        mhc_cases.append((case, lambda c=case, t=num_tokens: check_hc_head(c, t, 4, 4096, bf16, cuda,
                                                                           hyper.hc_head, normed=True)))
    for num_tokens in (1, 8, 64):
        case = f"hc_post_mix_t{num_tokens}"
        mhc_cases.append((case, lambda c=case, t=num_tokens: check_hc_post_mix(c, t, 4, 4096, bf16, cuda)))
        case = f"embed_mix_t{num_tokens}"
        mhc_cases.append((case, lambda c=case, t=num_tokens: check_embed_streams(c, t, 4, 4096, bf16, cuda)))
    for num_tokens in (1, 2048):
        case = f"hc_post_t{num_tokens}"
        mhc_cases.append((case, lambda c=case, t=num_tokens: check_hc_post(c, t, 4, 4096, bf16, cuda, hyper.hc_post)))
        mhc_cases.append((f"{case}_addend", lambda c=f"{case}_addend", t=num_tokens: check_hc_post(
            c, t, 4, 4096, bf16, cuda, hyper.hc_post, with_addend=True)))
        case = f"hc_head_t{num_tokens}"
        mhc_cases.append((case, lambda c=case, t=num_tokens: check_hc_head(c, t, 4, 4096, bf16, cuda, hyper.hc_head)))
    norm_specs = [
        ("rms_d4096", "rms", (2048, 4096), 0), ("rms_d1024_t1", "rms", (1, 1024), 0),
        ("unweighted_heads", "unweighted", (64, 64, 512), 0), ("rope_heads", "rope", (64, 64, 512), 32),
        ("q_t1", "q", (1, 64, 512), 32), ("q_t2048", "q", (2048, 64, 512), 32),
        ("kv_t64", "kv", (64, 512), 32), ("inverse_t64", "inverse", (64, 64, 512), 32),
    ]
    norm_cases: list[Case] = [
        (case_id, lambda c=case_id, o=op, s=shape, r=half: check_norm_rope(c, o, s, r, bf16, cuda, _Model))
        for case_id, op, shape, half in norm_specs
    ]
    return (mhc_cases if only != "norm" else []) + (norm_cases if only != "mhc" else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("interpret", "cuda", "model"), required=True)
    parser.add_argument("--only", choices=("mhc", "norm"), default=None)
    args = parser.parse_args(argv)
    if args.suite == "model":
        from moemesh.bench.checks.glue_kernel_runs import model_forward_check

        print(json.dumps(model_forward_check()), flush=True)
        return 0
    if args.suite == "interpret":
        from moemesh.bench.checks.quantized_kernels import patch_interpreter_bf16_dot

        patch_interpreter_bf16_dot()  # bf16x3's dots
    cases = interpret_cases(args.only) if args.suite == "interpret" else cuda_cases(args.only)
    failed = 0
    for case_id, run_case in cases:
        result = run_case()
        failed += not result.passed
        print(json.dumps({**asdict(result), "passed": result.passed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
