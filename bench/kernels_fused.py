"""Fused per-layer glue (mHC, RMS norms, RoPE, the MoE gate) against its torch code on CUDA, V4-Flash shapes.

Usage: python -m moemesh.bench.kernels_fused [--out-dir DIR] [--tokens 1,8,64,2048] [--sweep]

For each op and token count: the median device time per call of a CUDA-graph replay (as
bench.kernels: the graph removes host launch overhead, so this is what a captured decode step
sees), for the Triton path (default dispatch) and the torch path (`forced_torch_glue`); the kernel
launches per call (torch.profiler, eager); the fewest bytes the op must move (each input read once,
each output written once) and time / floor at the copy bandwidth measured in the same run.
Several input copies are rotated so that large inputs come from HBM; the small decode inputs stay
in L2, as they would in a decode step; the gate's weight [256, 4096] bf16 (2 MiB) is rotated over
GATE_COPIES copies, more than L2 holds, as in a decode step where 43 layers' weights pass between two
uses, so its floor is the weight's bytes / copy bandwidth. --sweep also times mHC launch configurations.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from moemesh.bench.timing import floor_ratio, graph_median_s
from moemesh.bench.timing import floor_s as bytes_floor_s

HIDDEN, NUM_STREAMS, NUM_HEADS, HEAD_DIM, ROPE_HALF, Q_LORA = 4096, 4, 64, 512, 32, 1024
NUM_ITERS, EPS = 20, 1e-6
ROTATE_BYTES = 256 * 1024**2
MAX_COPIES = 16
GATE_COPIES = 64  # 128 MiB of gate weights: more than the 60 MB L2
NUM_EXPERTS, TOP_K, HASH_LAYER, LEARNED_LAYER = 256, 6, 0, 3  # V4-Flash: layers 0-2 hash-routed


def _ops(num_tokens: int, device, generator):
    """name -> (make_inputs() -> tuple, call(inputs) -> tensor(s), min bytes per call)."""
    import torch

    from moemesh.common.model import hyper, linear, moe, presets, rope

    bf16, f32 = torch.bfloat16, torch.float32
    num_mix = (2 + NUM_STREAMS) * NUM_STREAMS
    k = NUM_STREAMS * HIDDEN

    def randn(*shape, dtype=bf16, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    def mhc_weights(rows):
        return randn(rows, k, dtype=f32, scale=2 / k**0.5), randn(rows, dtype=f32), randn(3, dtype=f32).abs() + 0.5

    def angles():
        a = randn(num_tokens, ROPE_HALF, dtype=f32, scale=100)
        return a.cos(), a.sin()

    flash = presets.preset_config("v4-flash")

    def gate_inputs(layer):
        gate = moe.Gate(flash, layer, dtype=bf16, device=device).requires_grad_(False)
        gate.weight.copy_(randn(NUM_EXPERTS, HIDDEN, scale=HIDDEN**-0.5))
        if hasattr(gate, "bias"):
            gate.bias.copy_(randn(NUM_EXPERTS, dtype=f32, scale=0.1))
        else:
            gate.tid2eid.copy_(torch.randint(0, NUM_EXPERTS, gate.tid2eid.shape, generator=generator, device=device))
        token_ids = torch.randint(0, flash.vocab_size, (num_tokens,), generator=generator, device=device)
        return randn(num_tokens, HIDDEN), gate, token_ids

    t = num_tokens
    h_bytes, d_bytes = t * k * 2, t * HIDDEN * 2
    gate_bytes = NUM_EXPERTS * HIDDEN * 2 + d_bytes + t * TOP_K * (8 + 2)  # W, x, ids + weights
    heads_bytes = t * NUM_HEADS * HEAD_DIM * 2
    return {
        "hc_pre": (lambda: (randn(t, NUM_STREAMS, HIDDEN), *mhc_weights(num_mix)),
                   lambda a: hyper.hc_pre(*a, NUM_ITERS, EPS, EPS),
                   h_bytes + num_mix * k * 4 + d_bytes + t * (NUM_STREAMS + NUM_STREAMS**2) * 4),
        "hc_pre_normed": (lambda: (randn(t, NUM_STREAMS, HIDDEN), *mhc_weights(num_mix), randn(HIDDEN, dtype=f32)),
                          lambda a: hyper.hc_pre(*a[:4], NUM_ITERS, EPS, EPS, out_norm=(a[4], EPS)),
                          h_bytes + num_mix * k * 4 + d_bytes + t * (NUM_STREAMS + NUM_STREAMS**2) * 4),
        "hc_pre_then_rms_norm": (lambda: (randn(t, NUM_STREAMS, HIDDEN), *mhc_weights(num_mix),
                                          randn(HIDDEN, dtype=f32)),
                                 lambda a: linear.rms_norm(hyper.hc_pre(*a[:4], NUM_ITERS, EPS, EPS)[0], a[4], EPS),
                                 h_bytes + num_mix * k * 4 + d_bytes + t * (NUM_STREAMS + NUM_STREAMS**2) * 4),
        "hc_post": (lambda: (randn(t, HIDDEN), randn(t, NUM_STREAMS, HIDDEN), randn(t, NUM_STREAMS, dtype=f32),
                             randn(t, NUM_STREAMS, NUM_STREAMS, dtype=f32)),
                    lambda a: hyper.hc_post(*a), d_bytes + 2 * h_bytes),
        "hc_head": (lambda: (randn(t, NUM_STREAMS, HIDDEN), *mhc_weights(NUM_STREAMS)),
                    lambda a: hyper.hc_head(a[0], a[1], a[2], a[3][:1], EPS, EPS),
                    h_bytes + NUM_STREAMS * k * 4 + d_bytes),
        "rms_norm_d4096": (lambda: (randn(t, HIDDEN), randn(HIDDEN, dtype=f32)),
                           lambda a: linear.rms_norm(a[0], a[1], EPS), 2 * d_bytes),
        "q_norm_d1024": (lambda: (randn(t, Q_LORA), randn(Q_LORA, dtype=f32)),
                         lambda a: linear.rms_norm(a[0], a[1], EPS), 2 * t * Q_LORA * 2),
        "q_heads_norm_rope": (lambda: (randn(t, NUM_HEADS, HEAD_DIM), *angles()),
                              lambda a: rope.rms_norm_rope(a[0], a[1], a[2], EPS), 2 * heads_bytes),
        "q_heads_norm_then_rope": (lambda: (randn(t, NUM_HEADS, HEAD_DIM), *angles()),
                                   lambda a: rope.apply_rope(linear.unweighted_rms_norm(a[0], EPS), a[1], a[2]),
                                   2 * heads_bytes),
        "kv_norm_rope": (lambda: (randn(t, HEAD_DIM), randn(HEAD_DIM, dtype=f32), *angles()),
                         lambda a: rope.rms_norm_rope(a[0], a[2], a[3], EPS, a[1]), 2 * t * HEAD_DIM * 2),
        "inverse_rope_heads": (lambda: (randn(t, NUM_HEADS, HEAD_DIM), *angles()),
                               lambda a: rope.inverse_rope(*a), 2 * heads_bytes),
        "gate_learned": (lambda: gate_inputs(LEARNED_LAYER), lambda a: a[1](a[0], a[2]),
                         gate_bytes + NUM_EXPERTS * 4),
        "gate_hash": (lambda: gate_inputs(HASH_LAYER), lambda a: a[1](a[0], a[2]), gate_bytes + t * (8 + TOP_K * 8)),
    }


def _launches(call, num_calls: int = 5) -> tuple[int, dict[str, float]]:
    """(kernel launches per call, {kernel name: device µs per call}) from torch.profiler, eager."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_calls):
            call()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    per_kernel = {e.key[:80]: e.self_device_time_total / num_calls for e in events}
    return sum(e.count for e in events) // num_calls, per_kernel


def _time_variant(make_inputs, call, min_bytes: int, forced_torch: bool, max_copies: int = MAX_COPIES) -> dict:
    from moemesh.common.kernels.glue import forced_torch_glue

    num_copies = max(2, min(max_copies, ROTATE_BYTES // max(min_bytes, 1)))
    copies = [make_inputs() for _ in range(num_copies)]
    with forced_torch_glue(forced_torch):
        seconds = graph_median_s([lambda a=a: call(a) for a in copies])
        launches, per_kernel_us = _launches(lambda: call(copies[0]))
    return {"seconds": seconds, "launches": launches, "per_kernel_us": per_kernel_us}


def _sweep_mhc(num_tokens: int, device, generator) -> dict:
    """hc_pre with alternative launch configurations (Triton only)."""
    import torch

    from moemesh.common.kernels import mhc

    make_inputs, _, _ = _ops(num_tokens, device, generator)["hc_pre"]
    copies = [make_inputs() for _ in range(4)]
    base = mhc.choose_mix_config(num_tokens, NUM_STREAMS * HIDDEN, device, torch.bfloat16)
    changes = {"heuristic": {}}
    for splits in (base.num_splits // 4, base.num_splits // 2, base.num_splits * 2):
        if 1 <= splits <= 128:
            changes[f"splits{splits}"] = {"num_splits": splits}
    finish_shapes = ((1, 256), (1, 1024), (2, 512)) if num_tokens <= 64 else ((1, 512), (4, 1024), (4, 4096),
                                                                               (8, 4096), (2, 2048))
    for warps, block_d in finish_shapes:
        if (warps, block_d) != (base.finish_num_warps, base.block_d):
            changes[f"finish_w{warps}_bd{block_d}"] = {"finish_num_warps": warps, "block_d": block_d}
    changes["approx_div"] = {"approx_division": True}
    if num_tokens <= 16:
        changes["gemv_bk64"] = {"block_k": 64}
        changes["dot_bf16x3_bt16"] = {"block_t": 16, "precision": "bf16x3", "num_splits": 64}
    elif num_tokens <= 64:
        changes["dot_bf16x3_bt32"] = {"block_t": 32}
    else:
        changes["bf16x3_bk128_w8"] = {"block_k": 128}
        changes["splits16"] = {"num_splits": 16}
    variants = {name: replace(base, **change) for name, change in changes.items()}
    results = {}
    for name, config in variants.items():
        try:
            results[name] = graph_median_s([lambda a=a, c=config: mhc.hc_pre(*a, NUM_ITERS, EPS, EPS, config=c)
                                          for a in copies])
        except Exception as exc:  # a config the compiler rejects is reported, not fatal
            results[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    torch.cuda.synchronize()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--tokens", default="1,8,64,2048")
    parser.add_argument("--ops", default=None, help="comma-separated subset of the ops")
    parser.add_argument("--sweep", action="store_true", help="also time mHC launch configurations")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.kernels_fused needs a CUDA device", file=sys.stderr)
        return 2
    from moemesh.bench.kernels import measure_ceilings
    from moemesh.bench.results_io import write_result

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    ceilings = measure_ceilings()
    copy_rate = ceilings["copy_bytes_per_s"]
    rows, sweeps = [], {}
    print(f"copy {copy_rate / 1e12:.2f} TB/s")
    print(f"{'op':24} {'T':>5} {'fused us':>9} {'torch us':>9} {'x':>6} {'floor us':>9} {'fused/floor':>11} "
          f"{'launches f/t':>12}")
    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        ops = _ops(num_tokens, device, generator)
        for name, (make_inputs, call, min_bytes) in ops.items():
            if args.ops and name not in args.ops.split(","):
                continue
            copies = GATE_COPIES if name.startswith("gate") else MAX_COPIES
            fused = _time_variant(make_inputs, call, min_bytes, forced_torch=False, max_copies=copies)
            reference = _time_variant(make_inputs, call, min_bytes, forced_torch=True, max_copies=copies)
            floor_s = bytes_floor_s(min_bytes, copy_rate)
            row = {"op": name, "num_tokens": num_tokens, "min_bytes": min_bytes, "floor_s": floor_s,
                   "fused_s": fused["seconds"], "torch_s": reference["seconds"],
                   "fused_launches": fused["launches"], "torch_launches": reference["launches"],
                   "fused_kernels_us": fused["per_kernel_us"]}
            rows.append(row)
            print(f"{name:24} {num_tokens:5d} {row['fused_s'] * 1e6:9.2f} {row['torch_s'] * 1e6:9.2f} "
                  f"{row['torch_s'] / row['fused_s']:6.1f} {floor_s * 1e6:9.2f} {row['fused_s'] / floor_s:11.1f} "
                  f"{row['fused_launches']:5d}/{row['torch_launches']:<6d}", flush=True)
            if name.startswith("hc_"):  # where the fused op's device time goes (profiled eager launches)
                print("    " + ", ".join(f"{k.split('(')[0][:40]} {v:.2f}" for k, v in fused["per_kernel_us"].items()))
            torch.cuda.empty_cache()
        if args.sweep:
            sweeps[str(num_tokens)] = _sweep_mhc(num_tokens, device, generator)
            timings = sweeps[str(num_tokens)]
            print(f"hc_pre sweep T={num_tokens} (us): " + ", ".join(
                f"{k} {v * 1e6:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in timings.items()), flush=True)
    ratios = {f"{r['op']} T={r['num_tokens']}": {"speedup_vs_torch": r["torch_s"] / r["fused_s"],
                                                  "time_vs_floor": floor_ratio(r["fused_s"], r["floor_s"])} for r in rows}
    path = write_result("kernels-fused", {"ceilings": ceilings, "rows": rows, "hc_pre_sweeps": sweeps}, ratios,
                        out_dir=args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
