"""The DSpark drafter through the fused glue (`hc_pre` with out_norm, `rms_norm_rope`, `inverse_rope`) gives the
outputs of the unfused composition it replaced (hc_pre then the block norm; norm then RoPE; RoPE by -sin).

CPU torch path: bit-equal (the fused entry points run the same two-step torch code there).
Triton path: a child process with TRITON_INTERPRET=1 and MOEMESH_TRITON_GLUE_ON_CPU=1 runs both
compositions through the kernels (fused launches vs separate launches), fp32 and bf16.
The unfused reference below is the drafter's unfused composition, kept here as the oracle.
Legend: A blocks, G slots, C context positions, D hidden, H heads, hd head dim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.config import NumericsConfig
from moemesh.common.model.dspark import DSparkDrafter, _attend_blocks
from moemesh.common.model.hyper import hc_head, hc_post, hc_pre
from moemesh.common.model.linear import unweighted_rms_norm
from moemesh.common.model.rope import apply_rope

BLOCK = 4


def _drafter(dtype: str = "float32") -> DSparkDrafter:
    config = tiny_config(compress_ratios=[0, 4, 128, 4, 0, 0, 0], num_nextn_predict_layers=3, dspark_block_size=BLOCK,
                         dspark_markov_rank=16, dspark_target_layer_ids=[1, 2, 3], dspark_noise_token_id=255)
    hub_sd = random_hub_state_dict(config, seed=5)
    numerics = NumericsConfig(dtype=dtype)
    side = AttentionSide.from_state_dict(config, hub_sd, numerics)
    return DSparkDrafter.from_state_dict(config, hub_sd, side.embed, side.head, numerics)


def _unfused_attention(drafter, attn, x, main_x, context_positions, context_valid, positions):
    num_blocks, num_slots = positions.shape
    num_context = main_x.shape[1]
    cos, sin = attn.rope.cos_sin(positions.reshape(-1))
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(num_blocks * num_slots, attn.num_heads, attn.head_dim)
    q = apply_rope(unweighted_rms_norm(q, drafter.config.rms_norm_eps), cos, sin)  # [A·G, H, hd]
    block_kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin).view(num_blocks, num_slots, -1)
    context_cos, context_sin = attn.rope.cos_sin(context_positions.reshape(-1).clamp_min(0))
    context_kv = apply_rope(attn.kv_norm(attn.wkv(main_x.reshape(num_blocks * num_context, -1))),
                            context_cos, context_sin).view(num_blocks, num_context, attn.head_dim)
    keys = torch.cat([context_kv, block_kv.to(context_kv.dtype)], dim=1)  # [A, C + G, hd]
    visible = torch.cat([context_valid[:, None, :].expand(-1, num_slots, -1),
                         torch.ones(num_blocks, num_slots, num_slots, dtype=torch.bool)], dim=-1)
    out = _attend_blocks(q.view(num_blocks, num_slots, attn.num_heads, -1), keys, visible, attn.attn_sink,
                         attn.scale).reshape(num_blocks * num_slots, attn.num_heads, -1)
    out = apply_rope(out, cos, -sin)
    return attn.wo_b(attn.wo_a(out.reshape(num_blocks * num_slots, drafter.config.o_groups, -1)))


def _unfused_block_hidden(drafter, main_x, context_positions, context_valid, block_token_ids, block_positions):
    c = drafter.config
    num_blocks, num_slots = block_token_ids.shape
    flat_ids = block_token_ids.reshape(-1)
    h = drafter.embed(flat_ids).unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()  # [A·G, N, D]
    for j, stage in enumerate(drafter.mtp):
        x, post, comb = hc_pre(h, stage.hc_attn_fn, stage.hc_attn_base, stage.hc_attn_scale, c.hc_sinkhorn_iters,
                               c.hc_eps, c.rms_norm_eps)
        y = _unfused_attention(drafter, stage.attn, stage.attn_norm(x), main_x, context_positions, context_valid,
                               block_positions)
        h = hc_post(y, h, post, comb)
        x, post, comb = hc_pre(h, stage.hc_ffn_fn, stage.hc_ffn_base, stage.hc_ffn_scale, c.hc_sinkhorn_iters,
                               c.hc_eps, c.rms_norm_eps)
        x = stage.ffn_norm(x)
        ids, weights = stage.ffn.gate(x, flat_ids)
        h = hc_post(drafter.experts_fn(j, x, ids, weights) + stage.ffn.shared_experts(x), h, post, comb)
    last = drafter.mtp[-1]
    return hc_head(h, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, c.hc_eps, c.rms_norm_eps
                   ).view(num_blocks, num_slots, -1)


def _inputs(drafter, num_blocks: int = 2, num_context: int = 6):
    gen = torch.Generator().manual_seed(1)
    c = drafter.config
    features = torch.randn(num_blocks, num_context, 3 * c.hidden_size, generator=gen)
    main_x = drafter.fuse_features(features)  # [A, C, D]
    context_positions = torch.arange(num_context).repeat(num_blocks, 1)
    context_valid = torch.ones(num_blocks, num_context, dtype=torch.bool)
    context_valid[1, :2] = False  # the second block's sequence is shorter
    seeds = torch.randint(0, c.vocab_size, (num_blocks,), generator=gen)
    positions = num_context + torch.arange(BLOCK).repeat(num_blocks, 1)
    return main_x, context_positions, context_valid, drafter.block_inputs(seeds), positions


def compare(dtype: str) -> dict:
    """Both compositions on the same inputs -> {max_abs_diff, scale, fused_glue_on}."""
    from moemesh.common.kernels.glue import use_triton_glue

    drafter = _drafter(dtype)
    args = _inputs(drafter)
    with torch.no_grad():
        fused = drafter.block_hidden(*args).float()
        unfused = _unfused_block_hidden(drafter, *args).float()
    return {"max_abs_diff": float((fused - unfused).abs().max()), "scale": float(unfused.abs().max()),
            "finite": bool(torch.isfinite(fused).all()), "triton_glue": use_triton_glue(torch.zeros(1))}


def test_fused_glue_is_bit_equal_on_the_torch_path():
    result = compare("float32")
    assert not result["triton_glue"] and result["finite"]
    assert result["max_abs_diff"] == 0.0, result


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "MOEMESH_TRITON_GLUE_ON_CPU": "1", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 4e-3)])
def test_fused_glue_matches_unfused_through_the_kernels(interpreted, dtype, tolerance):
    """fp32: equal up to fp32 summation order. bf16: the fused launches keep the unfused roundings
    (x rounded to bf16 before the norm), so at most summation order differs: bound one bf16 ulp of
    the largest output (measured: bit-equal in both dtypes)."""
    result = interpreted[dtype]
    assert result["triton_glue"] and result["finite"], result
    assert result["max_abs_diff"] <= tolerance * max(1.0, result["scale"]), result


if __name__ == "__main__":  # the interpreted child of `interpreted`
    from moemesh.bench.checks.quantized_kernels import patch_interpreter_bf16_dot, patch_interpreter_bf16_rounding

    patch_interpreter_bf16_dot()
    patch_interpreter_bf16_rounding()
    torch.set_num_threads(1)
    print(json.dumps({dtype: compare(dtype) for dtype in ("float32", "bfloat16")}))
