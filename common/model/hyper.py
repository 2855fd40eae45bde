"""Manifold-constrained hyper-connections (mHC, docs/model.md §2.2): the residual lives in `n` streams.

`hc_pre` collapses the streams into one block input and returns the `post` (expand) weights and the
doubly-stochastic `comb` (stream mixing) matrix; `hc_post` folds the block output back in:
h'_k = post_k · y + Σ_j comb[j, k] · h_j  (combᵀ h: comb is not symmetric, direction matters).
All mixing weights are computed in fp32.
On CUDA tensors the fused Triton kernels of `common.kernels.mhc` run instead (two launches for
hc_pre / hc_head, one for hc_post, which also sums the routed slots and adds the shared expert's
output; `common.kernels.glue` says when): this torch code stays the CPU path and the reference they
are tested against.
Legend: T tokens, N streams (hc_mult), D hidden, M = (2 + N) · N mix width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moemesh.common.kernels.glue import use_triton_glue
from moemesh.common.kernels.moe_layout import sum_slots_in_order
from moemesh.common.model.linear import rms_norm, unweighted_rms_norm


def hc_pre(
    h: torch.Tensor,  # [T, N, D]
    fn: torch.Tensor,  # [M, N·D]
    base: torch.Tensor,  # [M]
    scale: torch.Tensor,  # [3]
    num_sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    out_norm: tuple[torch.Tensor, float] | None = None,
    partials=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (x [T, D] in h's dtype, post [T, N] fp32, comb [T, N, N] fp32).

    out_norm (weight [D] fp32, eps): x comes back as RMSNorm(x), the block's attn_norm / ffn_norm; on
    CUDA the norm runs in hc_pre's finish launch (one launch fewer per site), same roundings as a
    separate `rms_norm`. partials: what `hc_post_with_mix` returned for this h and fn (on CUDA the mix
    GEMV was done in that launch; None: computed here)."""
    if use_triton_glue(h, fn, base, scale, *_norm_weight(out_norm)):
        from moemesh.common.kernels import mhc

        return mhc.hc_pre(h, fn, base, scale, num_sinkhorn_iters, hc_eps, norm_eps, out_norm=out_norm,
                          partials=partials)
    num_tokens, num_streams, _ = h.shape
    flat = unweighted_rms_norm(h.reshape(num_tokens, -1).float(), norm_eps)  # [T, N·D]
    mix = F.linear(flat, fn.float())  # [T, M]
    pre_w, post_w, comb_w = mix.split([num_streams, num_streams, num_streams * num_streams], dim=-1)
    pre_b, post_b, comb_b = base.float().split([num_streams, num_streams, num_streams * num_streams])
    pre_scale, post_scale, comb_scale = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps  # [T, N]; not normalised to sum 1
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)  # [T, N] in (0, 2)
    comb_logits = comb_w.view(num_tokens, num_streams, num_streams) * comb_scale + comb_b.view(num_streams, num_streams)
    comb = torch.softmax(comb_logits, dim=-1) + hc_eps  # [T, N(j in), N(k out)]
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(num_sinkhorn_iters - 1):  # Sinkhorn: rows, then columns
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    x = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # [T, D]
    return _normed(x, out_norm), post, comb


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            y_addend: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, D] block output, h [T, N, D] streams -> new streams [T, N, D].

    y [T, K, D]: the routed experts' per-slot outputs; the block output is their `sum_slots_in_order`
    (slot 0 + slot 1 + ..., rounded to y's dtype after each addition), on CUDA inside the hc_post launch.
    y_addend [T, D]: the block output is y + y_addend (the MoE's routed + shared), added in y's dtype
    first, as a separate `y + y_addend` would; on CUDA inside the hc_post launch."""
    fused_add = y_addend is None or y_addend.dtype == y.dtype
    if y.dtype == h.dtype and fused_add and use_triton_glue(y, h, post, comb, *(() if y_addend is None else (y_addend,))):
        from moemesh.common.kernels import mhc_streams

        return mhc_streams.hc_post(y, h, post, comb, y_addend=y_addend)
    if y.dim() == 3:  # [T, K, D] routed slots
        y = sum_slots_in_order(y)
    if y_addend is not None:
        y = y + y_addend
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


def hc_post_with_mix(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, next_fn: torch.Tensor,
                     y_addend: torch.Tensor | None = None):
    """`hc_post` (y [T, D], or routed slots [T, K, D]), plus launch 1 of the hc_pre that reads the result next
    (fn `next_fn` [M, N·D]) done in the same launch on CUDA at decode sizes -> (new streams [T, N, D], partials
    for `hc_pre(..., partials=)` or None)."""
    fused_add = y_addend is None or y_addend.dtype == y.dtype
    if (y.dtype == h.dtype and fused_add and next_fn.dtype == torch.float32
            and use_triton_glue(y, h, post, comb, next_fn, *(() if y_addend is None else (y_addend,)))):
        from moemesh.common.kernels import mhc_streams

        return mhc_streams.hc_post_with_mix(y, h, post, comb, next_fn.contiguous(), y_addend=y_addend)
    return hc_post(y, h, post, comb, y_addend=y_addend), None


def embed_streams(token_ids: torch.Tensor, table: torch.Tensor, num_streams: int, dtype: torch.dtype,
                  next_fn: torch.Tensor | None = None):
    """token_ids [T], embedding table [V, D] -> (streams [T, N, D] in dtype, N copies of each token's row;
    partials of the first hc_pre (fn `next_fn` [M, N·D]) for `hc_pre(..., partials=)` or None): one launch on
    CUDA at decode sizes."""
    if next_fn is not None and next_fn.dtype == torch.float32 and use_triton_glue(token_ids, table, next_fn):
        from moemesh.common.kernels import mhc_streams

        return mhc_streams.embed_streams(token_ids, table, num_streams, dtype, next_fn.contiguous())
    rows = F.embedding(token_ids, table).to(dtype)  # [T, D]
    return rows.unsqueeze(1).expand(-1, num_streams, -1).contiguous(), None


def hc_head(
    h: torch.Tensor,  # [T, N, D]
    fn: torch.Tensor,  # [N, N·D]
    base: torch.Tensor,  # [N]
    scale: torch.Tensor,  # [1]
    hc_eps: float,
    norm_eps: float,
    out_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Final collapse of the streams (no Sinkhorn) -> [T, D]; out_norm (weight [D] fp32, eps): followed
    by the final `RMSNorm`, one launch fewer on CUDA."""
    if use_triton_glue(h, fn, base, scale, *_norm_weight(out_norm)):
        from moemesh.common.kernels import mhc

        return mhc.hc_head(h, fn, base, scale, hc_eps, norm_eps, out_norm=out_norm)
    flat = unweighted_rms_norm(h.reshape(h.shape[0], -1).float(), norm_eps)
    mix = F.linear(flat, fn.float())  # [T, N]
    weights = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return _normed((weights.unsqueeze(-1) * h).sum(dim=1).to(h.dtype), out_norm)


def _norm_weight(out_norm: tuple[torch.Tensor, float] | None) -> tuple[torch.Tensor, ...]:
    """The norm weight as a tensor the glue dispatch must also see on CUDA (none without out_norm)."""
    return () if out_norm is None else (out_norm[0],)


def _normed(x: torch.Tensor, out_norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    return x if out_norm is None else rms_norm(x, *out_norm)
