"""Where a decode step's device time goes: torch.profiler over eager decode steps of `bench.layers`' stack.

Usage: python -m moemesh.bench.layers_profile [--layers csa,hca] [--batch 1] [--context 4096] [--steps 3] [--graphs]
       python -m moemesh.bench.layers_profile --prefill 8192 [--steps 2]
Prints the kernels by total device time and the number of kernel launches per step (a CUDA graph
removes host gaps, not the ~2-3 us each small kernel costs on the device); with `--graphs` it profiles
replays of each piece's CUDA graph instead (what `bench.layers` times and counts). With `--prefill N` it
profiles one-forward prefills of an N-token prompt instead (as `bench.layers` times them, eager)
and also prints the step's wall time against its summed device time: a large gap means the host
(Python loops, syncs) and not the kernels holds the prefill back.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moemesh.bench import layers_timing as timing
    from moemesh.common.model.random_init import LAYER_KIND_NAMES, flash_config, random_model, tiny_flash_like_config

    parser = argparse.ArgumentParser(prog="python -m moemesh.bench.layers_profile")
    parser.add_argument("--layers", default="csa,hca")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="steps (prefill: forwards, >= 2) per profile")
    parser.add_argument("--prefill", type=int, default=None, help="profile prefills of this many tokens")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same structure (CPU smoke run)")
    parser.add_argument("--graphs", action="store_true", help="profile CUDA-graph replays, piece by piece")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    kinds = [LAYER_KIND_NAMES[k] for k in args.layers.split(",")]
    config = tiny_flash_like_config(kinds) if args.tiny else flash_config(kinds)
    side, experts = random_model(config, device)
    if args.prefill:
        return _profile_prefill(side, experts, config, args.prefill, args.steps, args.top)
    states = timing.decode_states(config, args.batch, args.context, torch.bfloat16, device, 0)
    if args.graphs:
        timed = timing.time_decode(side, experts, states, config.vocab_size, num_steps=1, profile_kernels=True)
        for piece, seen in timed.kernels.items():
            print(f"{piece}: {seen['kernels']:.1f} kernels + {seen['copies']:.1f} copies, "
                  f"{seen['device_us']:.1f} us device time per replay")
            for name, us, count in seen["top"][:args.top]:
                print(f"  {us:9.2f} us {count:5.2f}x  {name}")
        return 0
    timing.time_decode(side, experts, states, config.vocab_size, num_steps=1, use_graphs=False)  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timing.time_decode(side, experts, states, config.vocab_size, num_steps=args.steps - 1, use_graphs=False)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events)
    print(f"steps {args.steps} (incl. 1 warm-up), batch {args.batch}: {launches / args.steps:.0f} kernels/step, "
          f"{total_us / args.steps:.0f} us device time/step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
        print(f"{e.self_device_time_total / args.steps:9.1f} us/step {e.count / args.steps:7.1f}x  {e.key[:110]}")
    return 0


def _profile_prefill(side, experts, config, num_tokens: int, num_steps: int, top: int) -> int:
    """Eager prefills under torch.profiler: kernels by device time, and wall vs device time per step."""
    from torch.profiler import ProfilerActivity, profile

    from moemesh.bench import layers_timing as timing
    from moemesh.bench.timing import wall_s as wall_times_s

    timing.time_prefill(side, experts, config, num_tokens, num_reps=1)  # warm-up (compiles)
    device = side.head.weight.device
    wall_s = wall_times_s(lambda: timing.time_prefill(side, experts, config, num_tokens, num_reps=num_steps - 1),
                          device, repeats=1)[0] / num_steps
    on_cuda = side.head.weight.is_cuda
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        timing.time_prefill(side, experts, config, num_tokens, num_reps=num_steps - 1)
    events = [e for e in prof.key_averages() if e.device_type.name == ("CUDA" if on_cuda else "CPU")]
    own_us = (lambda e: e.self_device_time_total) if on_cuda else (lambda e: e.self_cpu_time_total)
    total_us = sum(own_us(e) for e in events)
    launches = sum(e.count for e in events)
    print(f"prefill {num_tokens} tokens, {num_steps} forwards: {launches / num_steps:.0f} kernels/forward, "
          f"{total_us / num_steps:.0f} us device time/forward, {wall_s * 1e6:.0f} us wall/forward "
          f"(unprofiled, includes state allocation)")
    for e in sorted(events, key=lambda e: -own_us(e))[:top]:
        print(f"{own_us(e) / num_steps:9.1f} us/fwd {e.count / num_steps:7.1f}x  {e.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
