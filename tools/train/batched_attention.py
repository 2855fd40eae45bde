"""Batched full-window attention for training: B windows, every one starting at position 0.

The model core's `Attention.forward` serves decode state and loops over sequences; training wants
B equal-length windows from position 0 in a few large kernels. This function computes the same
thing from the same modules and functions (`wq_a`/`q_norm`/`wq_b`/`wkv`/`kv_norm`/`wo_a`/`wo_b`,
`Compressor.project` + `.norm`, `Indexer.project_queries` + `.select`, `attend_with_sink`, the
RoPE tables): only the compressor's window pooling (`Compressor.emit`) is written here in batch
form, because from position 0 every closed window is known up front. Equality with the core path
is a test (tests/test_default_model_training.py).
Legend: B windows, S tokens per window, T = B·S, H heads, hd head dim, R compressed rows per
window, m ratio, d row dim, C compressor input width.
"""

from __future__ import annotations

import torch

from moemesh.common.model.attention import Attention, attend_with_sink
from moemesh.common.model.compressor import Compressor
from moemesh.common.model.rope import apply_rope
from moemesh.common.model.linear import unweighted_rms_norm


def pooled_rows(compressor: Compressor, x: torch.Tensor, positions: torch.Tensor, num_windows: int,
                rope) -> torch.Tensor:
    """Every closed window's row of B windows from position 0: x [T, D] -> rows [B, R, d]
    (R = S // m), normed and rotated at w·m; `Compressor.emit`'s pooling, all windows at once."""
    m, d = compressor.ratio, compressor.row_dim
    kv, score = compressor.project(x, positions)  # [T, C]
    seq_len = x.shape[0] // num_windows
    num_rows = seq_len // m
    kv = kv.float().view(num_windows, seq_len, -1)[:, : num_rows * m].view(num_windows, num_rows, m, -1)
    score = score.float().view(num_windows, seq_len, -1)[:, : num_rows * m].view(num_windows, num_rows, m, -1)
    if compressor.overlap:  # slots: a-halves of window w-1, b-halves of window w; window 0 has no a-slots
        prev_kv = torch.cat([torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], dim=1)
        prev_score = torch.cat([torch.full_like(score[:, :1, :, :d], float("-inf")), score[:, :-1, :, :d]], dim=1)
        slot_kv = torch.cat([prev_kv, kv[..., d:]], dim=2)  # [B, R, 2m, d]
        slot_score = torch.cat([prev_score, score[..., d:]], dim=2)
    else:
        slot_kv, slot_score = kv, score
    pooled = (slot_kv * torch.softmax(slot_score, dim=2)).sum(dim=2)  # [B, R, d]
    rows = compressor.norm(pooled.to(x.dtype))
    row_positions = torch.arange(num_rows, device=x.device) * m
    cos, sin = rope.cos_sin(row_positions)
    rotated = apply_rope(rows.transpose(0, 1).reshape(num_rows, num_windows, d), cos, sin)  # rope over rows
    return rotated.view(num_rows, num_windows, d).transpose(0, 1)


@torch.no_grad()
def batched_select(indexer, queries: torch.Tensor, head_weights: torch.Tensor, rows: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """`Indexer.select` for B windows at once: queries [B, S, H, d], head_weights [B, S, H],
    rows [B, R, d], positions [S] -> selected [B, S, R] bool. The selection is not differentiable,
    so nothing here is recorded for backward."""
    num_rows = rows.shape[1]
    visible = torch.arange(num_rows, device=rows.device)[None, :] < ((positions + 1) // indexer.ratio)[:, None]
    visible = visible.unsqueeze(0).expand(rows.shape[0], -1, -1)  # [B, S, R]
    num_keep = min(indexer.topk, num_rows)
    if num_keep == 0:
        return visible
    logits = torch.einsum("bshd,bnd->bshn", queries.float(), rows.float())  # [B, S, H, R]
    logits = torch.relu(logits) * indexer.head_dim**-0.5
    scores = torch.einsum("bshn,bsh->bsn", logits, head_weights.float())  # [B, S, R]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(num_keep, dim=-1).indices
    selected = torch.zeros_like(visible).scatter_(2, top, True)
    return selected & visible


def batched_attention(attn: Attention, x: torch.Tensor, num_windows: int) -> torch.Tensor:
    """x [T, D] (after attn_norm) of B windows of S tokens each, positions 0..S-1 -> [T, D]."""
    config = attn.config
    num_tokens = x.shape[0]
    seq_len = num_tokens // num_windows
    positions_one = torch.arange(seq_len, device=x.device)
    positions = positions_one.repeat(num_windows)  # [T]
    cos, sin = attn.rope.cos_sin(positions)
    q_lat = attn.q_norm(attn.wq_a(x))  # [T, R_q]
    q = attn.wq_b(q_lat).view(num_tokens, attn.num_heads, attn.head_dim)
    q = apply_rope(unweighted_rms_norm(q, config.rms_norm_eps), cos, sin)  # [T, H, hd]
    kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)  # [T, hd]
    delta = positions_one[:, None] - positions_one[None, :]
    visible = ((delta >= 0) & (delta < config.sliding_window)).expand(num_windows, -1, -1)  # [B, S, S]
    keys = kv.view(num_windows, seq_len, -1)
    if attn.compressor is not None:
        rows = pooled_rows(attn.compressor, x, positions, num_windows, attn.rope)  # [B, R, hd]
        num_rows = rows.shape[1]
        if attn.indexer is None:  # HCA: every closed window
            row_visible = torch.arange(num_rows, device=x.device)[None, :] < ((positions_one + 1) // attn.compressor.ratio)[:, None]
            row_visible = row_visible.expand(num_windows, -1, -1)
        else:  # CSA: the indexer's top-k among closed windows
            index_rows = pooled_rows(attn.indexer.compressor, x, positions, num_windows, attn.rope)  # [B, R, d_i]
            queries, head_weights = attn.indexer.project_queries(q_lat, x, cos, sin)
            queries = queries.view(num_windows, seq_len, *queries.shape[1:])
            head_weights = head_weights.view(num_windows, seq_len, -1)
            row_visible = batched_select(attn.indexer, queries, head_weights, index_rows, positions_one)
        keys = torch.cat([keys, rows.to(keys.dtype)], dim=1)
        visible = torch.cat([visible, row_visible], dim=2)
    out = torch.vmap(attend_with_sink, in_dims=(0, 0, 0, None, None))(
        q.view(num_windows, seq_len, attn.num_heads, -1), keys, visible, attn.attn_sink, attn.scale)
    out = apply_rope(out.reshape(num_tokens, attn.num_heads, -1), cos, -sin)
    return attn.wo_b(attn.wo_a(out.reshape(num_tokens, config.o_groups, -1)))
